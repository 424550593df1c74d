"""`generate_after_prefixes`: one prefix's pages shared by its continuations (a judge's
template head and prompt across a prompt's responses) give the tokens of generating each
`prefix + continuation` on its own, with the prefix computed once."""

import dataclasses

from rollout_testing import make_model, make_prompts

from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.batching import generate_after_prefixes

CONFIG = RolloutConfig(
    page_size=4, max_num_seqs=4, prompt_length=24, response_length=5, decode_steps_per_call=3
)


def test_shared_prefixes_equal_whole_prompts():
    engine = Engine(make_model(), CONFIG)
    prefixes = make_prompts((9, 6, 13), seed=3)  # full pages and a partial one each
    conts = [
        make_prompts(lengths, seed=4 + j) for j, lengths in enumerate([(3, 1, 5), (4,), (2, 6)])
    ]
    conts[1].append([])  # a row that samples right after its prefix
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    shared = generate_after_prefixes(engine, prefixes, conts, greedy)
    computed_shared = engine.num_prefill_tokens
    whole = [p + c for p, group in zip(prefixes, conts, strict=True) for c in group]
    alone = generate(engine, whole, greedy)
    computed_alone = engine.num_prefill_tokens - computed_shared
    assert shared == alone.responses.tolist()
    assert all(len(r) == 5 for r in shared)
    # each prefix once (less its last token, which extend feeds before the continuation)
    assert computed_shared == (8 + 5 + 12) + (3 + 1 + 5) + 4 + (2 + 6)
    assert computed_alone == sum(len(w) - 1 for w in whole)
    assert engine.num_free_pages == engine.num_pages * engine.replicas  # every page back


def test_shared_prefixes_under_preemption_equal_an_unpreempted_run():
    """A pool of 12 pages: continuations preempt each other, come back in other slots with
    their continuation already fed, and sample what the default pool does."""
    model = make_model()
    prefixes = make_prompts((9, 6, 13), seed=3)
    conts = [make_prompts(lengths, seed=4 + j) for j, lengths in enumerate([(3, 1, 5), (4, 2)])]
    conts.append(make_prompts((2, 6, 3), seed=9))
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=5, ignore_eos=True, seed=5)
    small = Engine(model, dataclasses.replace(CONFIG, num_pages=12))
    got = generate_after_prefixes(small, prefixes, conts, params)
    want = generate_after_prefixes(Engine(model, CONFIG), prefixes, conts, params)
    assert small.num_preemptions > 0
    assert got == want and all(len(r) == 5 for r in got)
    assert small.num_free_pages == small.num_pages and not small.preempted
