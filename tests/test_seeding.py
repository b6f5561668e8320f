"""64-bit seeds map to generators without aliasing (issue 47); sampling parameters the engine cannot
represent are refused or made safe (huge top_k, tiny temperature)."""
import struct

import pytest
import torch

from specserve import SamplingParams
from specserve.seeding import SEED_MAX, SEED_MIN, make_generator, mt19937_words, splitmix64
from specserve.errors import InvalidRequestError


def stream(seed: int, n: int = 8) -> list[float]:
    return torch.rand(n, generator=make_generator(seed)).tolist()


def test_equal_seeds_reproduce():
    for seed in (0, 1, -1, SEED_MAX, SEED_MIN, 123456789):
        assert stream(seed) == stream(seed)
        e1 = torch.empty(5).exponential_(generator=make_generator(seed))  # the sampler's draw
        assert torch.equal(e1, torch.empty(5).exponential_(generator=make_generator(seed)))


def test_seeds_do_not_alias():
    # torch's manual_seed keeps the low 32 bits on the CPU: all of these pairs would collide there
    pairs = [(-1, SEED_MAX), (5, 5 + 2**32), (7, 7 + 2**62), (0, SEED_MIN), (2**32 - 1, -1)]
    for a, b in pairs:
        plain = [torch.rand(8, generator=torch.Generator().manual_seed(x & (2**64 - 1))).tolist() for x in (a, b)]
        assert plain[0] == plain[1]  # the aliasing of torch's own seeding
        assert stream(a) != stream(b), (a, b)
    # and any two of many seeds that share their low 32 bits differ
    streams = {tuple(stream(3 + (k << 32), 4)) for k in range(-50, 50)}
    assert len(streams) == 100


def test_the_state_written_is_the_one_torch_uses():
    gen = make_generator(42)
    state = bytes(gen.get_state().tolist())
    words = list(struct.unpack_from("<624Q", state, 24))
    assert words == [int(w) for w in mt19937_words(42)]
    assert gen.initial_seed() == 42
    assert make_generator(-1).initial_seed() == 2**64 - 1


def test_splitmix64_reference_values():
    # SplitMix64 from seed 0 (Vigna's reference implementation)
    assert [hex(int(x)) for x in splitmix64(0, 3)] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4",
                                                        "0x6c45d188009454f"]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64, 10**30, 1.5, True])
def test_seeds_outside_64_bits_are_refused(seed):
    with pytest.raises(InvalidRequestError, match="seed"):
        make_generator(seed)
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_generators_keep_all_64_bits():
    def cuda_stream(seed):
        return torch.rand(8, device="cuda", generator=make_generator(seed, "cuda")).tolist()
    assert cuda_stream(-1) == cuda_stream(-1)
    assert cuda_stream(-1) != cuda_stream(SEED_MAX) and cuda_stream(5) != cuda_stream(5 + 2**32)


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=9e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=float("nan"))


def test_top_k_must_fit_in_64_bits():
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=10**30)


def test_tiny_temperature_and_huge_top_k_offline(tiny_target):
    from specserve import LLM
    threads = torch.get_num_threads()
    llm = LLM(model=str(tiny_target), dtype="float32", max_model_len=256, num_kv_blocks=64, num_threads=1)
    torch.set_num_threads(threads)
    prompt = "Offline engines too"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    tiny = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1e-40, seed=1, ignore_eos=True))[0]
    assert tiny.token_ids == greedy and tiny.token_ids != [0] * 16
    huge = SamplingParams(max_tokens=16, temperature=1.0, top_k=2**62, top_p=0.9, seed=5, ignore_eos=True)
    plain = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    assert llm.generate(prompt, huge)[0].token_ids == llm.generate(prompt, plain)[0].token_ids
    assert huge.top_k == 2**62  # the caller's params are left as given (sampling clamps to the vocabulary)


def test_position_uniforms_depend_on_seed_and_position_alone():
    from specserve.seeding import position_uniforms
    one = position_uniforms([9] * 6, list(range(6)))
    assert list(position_uniforms([9, 9], [4, 2])) == [one[4], one[2]]  # any order, any subset
    assert list(position_uniforms([3, 9, 3], [0, 5, 1])) == [position_uniforms([3], [0])[0], one[5],
                                                              position_uniforms([3], [1])[0]]
    for a, b in [(-1, SEED_MAX), (5, 5 + 2**32), (0, SEED_MIN)]:  # seeds that share their low 32 bits differ
        assert (position_uniforms([a] * 4, range(4)) != position_uniforms([b] * 4, range(4))).all()


def test_position_uniforms_are_uniform():
    from scipy import stats

    from specserve.seeding import position_uniforms
    across_positions = position_uniforms([11] * 20000, list(range(20000)))
    across_seeds = position_uniforms(list(range(-10000, 10000)), [3] * 20000)
    for u in (across_positions, across_seeds):
        assert ((0 <= u) & (u < 1)).all()
        assert stats.kstest(u, "uniform").pvalue > 1e-3
