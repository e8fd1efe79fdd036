"""eval/tune_gemm's choice between the committed table entry and a re-tune's fastest candidate (CPU)."""

from eightbit.eval.tune_gemm import choose
from eightbit.kernels.gemm_configs import GemmConfig

OLD = GemmConfig(16, 64, 256, 1, 1, 4, 6)
NEW = GemmConfig(16, 16, 256, 1, 1, 1, 6)
OTHER = GemmConfig(16, 32, 256, 1, 2, 4, 4)


def test_choose_keeps_the_committed_entry_unless_clearly_beaten():
    assert choose({OLD: 10.0, NEW: 9.9, OTHER: 10.5}, OLD) == OLD  # 1 % faster: the run's noise
    assert choose({OLD: 10.0, NEW: 9.81, OTHER: 10.5}, OLD) == OLD  # just under 2 %
    assert choose({OLD: 10.0, NEW: 9.79, OTHER: 10.5}, OLD) == NEW  # just over 2 %
    assert choose({OLD: 10.0, NEW: 9.5}, OLD, min_gain=0.06) == OLD
    assert choose({OLD: 9.0, NEW: 9.5}, OLD) == OLD  # the committed entry is still the fastest


def test_choose_takes_the_fastest_without_a_timed_committed_entry():
    assert choose({OLD: 10.0, NEW: 9.9}) == NEW  # a bucket the table did not hold
    assert choose({NEW: 9.9, OTHER: 9.7}, OLD) == OTHER  # the committed config failed its exactness check
