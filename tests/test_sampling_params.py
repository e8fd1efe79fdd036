import dataclasses

import numpy as np
import pytest

from eightbit.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    expected = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None,
                    max_tokens=16, stop=[], stop_token_ids=[], ignore_eos=False, logprobs=None,
                    prompt_logprobs=None, skip_special_tokens=True, presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=1.0, logit_bias=None, min_tokens=0,
                    include_stop_str_in_output=False)
    assert [f.name for f in dataclasses.fields(p)] == list(expected)
    assert dataclasses.asdict(p) == expected
    assert not p.greedy and not p.penalized and not p.adjusts_logits
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0} and SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(min_tokens=5, max_tokens=None).adjusts_logits
    assert all(SamplingParams(**{name: value}).penalized
               for name, value in (("presence_penalty", 0.1), ("frequency_penalty", -1), ("repetition_penalty", 1.1)))


def test_greedy_and_normalization():
    p = SamplingParams(temperature=0, stop="###", stop_token_ids=(5, 7), max_tokens=None, top_k=0)
    assert p.greedy
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.max_tokens is None
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(seed=0, logprobs=0, prompt_logprobs=3, top_k=1, top_p=0.01,
                          min_p=1.0, temperature=2).seed == 0


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("seed", 1.0), ("seed", "7"), ("seed", -1), ("seed", 2**63),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 3),
    ("stop_token_ids", [1, "2"]), ("stop_token_ids", 5), ("stop_token_ids", [-1]),
    ("logprobs", -1), ("logprobs", 1.0), ("prompt_logprobs", -2),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", 1e-40), ("repetition_penalty", 1e39),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),  # 17 > the default max_tokens 16
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 101}), ("logit_bias", {"1": 1.0}), ("logit_bias", [1]),
])
def test_invalid_values_raise_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert repr(value) in str(err.value)


def test_numpy_scalars_are_accepted_as_python_numbers():
    """Values computed with numpy (a swept top_p, an np.int64 seed) pass the same checks as Python's and reach the
    engine as Python ints and floats; numpy bools are refused as numbers like Python's, and taken as bools."""
    p = SamplingParams(temperature=np.float64(0.5), top_p=np.float32(0.5), top_k=np.int32(3), seed=np.int64(7),
                       max_tokens=np.int64(4), stop_token_ids=[np.int64(2)], logprobs=np.int16(1), n=np.int8(2))
    assert p == SamplingParams(temperature=0.5, top_p=0.5, top_k=3, seed=7, max_tokens=4, stop_token_ids=[2],
                               logprobs=1, n=2)
    assert all(type(getattr(p, f)) is int for f in ("top_k", "seed", "max_tokens", "logprobs", "n"))
    assert type(p.top_p) is float and type(p.stop_token_ids[0]) is int
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=np.bool_(True))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=np.float32("nan"))
    # a numpy bool is a bool where a bool is asked for (numpy 2 names its type numpy.bool, numpy 1 numpy.bool_)
    assert SamplingParams(ignore_eos=np.bool_(True), skip_special_tokens=np.False_).ignore_eos is True
    assert SamplingParams(skip_special_tokens=np.False_).skip_special_tokens is False


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs", "top_k"])
def test_a_setting_as_large_as_the_vocabulary_fits_it_and_one_more_does_not(field):
    SamplingParams(**{field: 320}).check_vocabulary(320)  # every token: allowed
    with pytest.raises(ValueError, match=f"{field}=321 exceeds the vocabulary size 320"):
        SamplingParams(**{field: 321}).check_vocabulary(320)
