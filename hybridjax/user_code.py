"""Loading a user's Python code named in the config (`custom_reward_function.path`,
`trainer.stages`): a file path or an importable module name."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from types import ModuleType


class CodeNotFound(ImportError):
    """`target` is neither a file nor an importable module."""


def load_module(target: str) -> ModuleType:
    """The Python file `target` (executed as a module named after its absolute path), else the
    importable module `target` (dotted name).

    Raises:
      CodeNotFound: `target` is neither a file nor an importable module (errors raised while
        running a file that exists propagate as they are).
    """
    if os.path.isfile(target):
        name = "hybridjax_user_" + re.sub(r"\W", "_", os.path.abspath(target))
        spec = importlib.util.spec_from_file_location(name, target)
        if spec is None or spec.loader is None:
            raise ImportError(f"{target}: not a Python source file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(target)
    except ImportError as err:
        raise CodeNotFound(str(err)) from err
