"""Rule-based reward functions: docs/verl_behaviour.md's cases, MATH `\\boxed{}`, the registry."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridjax.rewards import (
    default_compute_score,
    gsm8k,
    math_boxed,
    register_reward,
    registered_data_sources,
)

# (response, ground truth, strict score, flexible score): docs/verl_behaviour.md "Rewards" first.
GSM8K_CASES = [
    ("#### 1,234", "1234", 1.0, 1.0),
    ("First #### 3 then #### 4", "4", 1.0, 1.0),
    ("#### -7", "-7", 1.0, 1.0),
    ("The answer is 42", "42", 0.0, 1.0),
    # formatting a person would not call a different answer
    ("#### $18.00.", "18", 1.0, 1.0),
    ("#### **42**", "42", 1.0, 1.0),
    ("####  1234", "1,234", 1.0, 1.0),
    ("#### \u22127", "-7", 1.0, 1.0),
    ("#### 0.50", ".5", 1.0, 1.0),
    # wrong or missing answers
    ("#### 4 then #### 3", "4", 0.0, 0.0),
    ("#### 17", "18", 0.0, 0.0),
    ("no number at all", "18", 0.0, 0.0),
    ("#### seven", "7", 0.0, 0.0),
    # the whole response is searched; subtraction is not a negative sign
    ("She sells 16 - 3 - 4 = 9 eggs.\n" * 3 + "Then 9 * 2 = 18 dollars", "18", 0.0, 1.0),
    ("so the result is 20-5", "-5", 0.0, 0.0),
    ("3,4,5 → the last is 5", "5", 0.0, 1.0),
]


@pytest.mark.parametrize("response, truth, strict, flexible", GSM8K_CASES)
def test_gsm8k_cases(response, truth, strict, flexible):
    assert default_compute_score("openai/gsm8k", response, truth) == strict
    assert default_compute_score("openai/gsm8k@flexible", response, truth) == flexible
    assert default_compute_score("arithmetic", response, truth) == strict


def test_gsm8k_verl_keyword_scores():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "6", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 6", "6", score=2.0) == 2.0
    with pytest.raises(ValueError, match="unknown GSM8K extraction method"):
        gsm8k.extract_solution("#### 6", method="loose")


MATH_CASES = [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"first \boxed{1} then \boxed{2}", "2", 1.0),
    (r"first \boxed{1} then \boxed{2}", "1", 0.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    ("the answer is 5", "5", 0.0),
    (r"\boxed{5", "5", 0.0),  # unbalanced braces: no answer
    (r"\fbox{7}", r"\boxed{7}", 1.0),
]


@pytest.mark.parametrize("response, truth, score", MATH_CASES)
def test_math_boxed_cases(response, truth, score):
    assert default_compute_score("lighteval/MATH", response, truth) == score


def test_last_boxed_nested_braces():
    text = r"We get \boxed{\frac{a^{2}}{b}} done"
    assert math_boxed.last_boxed_only_string(text) == r"\boxed{\frac{a^{2}}{b}}"
    assert math_boxed.remove_boxed(r"\boxed{\frac{a^{2}}{b}}") == r"\frac{a^{2}}{b}"


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(ValueError, match="no reward function for data_source 'nope'") as e:
        default_compute_score("nope", "#### 1", "1")
    for source in ("openai/gsm8k", "arithmetic", "lighteval/MATH"):
        assert source in str(e.value)


def test_register_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("openai/gsm8k")(lambda s, g, e=None: 0.0)
    assert "openai/gsm8k" in registered_data_sources()


def test_register_new_source():
    @register_reward("test/length")
    def length_reward(solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str) == int(ground_truth)), "length": len(solution_str)}

    assert default_compute_score("test/length", "abc", "3") == {"score": 1.0, "length": 3}


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12), st.sampled_from(["", "$", "**"]), st.booleans())
def test_gsm8k_number_formatting_property(n, decoration, thousands):
    """A right answer scores 1 however it is written; the neighbouring number scores 0."""
    written = f"{n:,}" if thousands else str(n)
    response = f"Work... #### {decoration}{written}{decoration[::-1]}."
    assert gsm8k.compute_score(response, str(n)) == 1.0
    assert gsm8k.compute_score(response, f"{n:,}") == 1.0
    assert gsm8k.compute_score(response, str(n + 1)) == 0.0
    assert gsm8k.compute_score(f"so {written} it is", str(n), method="flexible") == 1.0
