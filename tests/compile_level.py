"""The LLVM optimisation level the suite compiles at: tests/conftest.py sets it before JAX starts,
tests/test_compile_level.py checks that the model computes the same functions at it as at the default."""

# XLA's CPU backend at LLVM optimisation level 0 instead of its default 3 (XLA's own HLO passes are unchanged;
# JAX's `jax_disable_most_optimizations` flag sets the same level). Compiling is most of the suite's CPU
# time on a cold cache: a fresh-clone run took 919 s of pytest and 1677 busy core-s at level 0 against 1112 s
# and 2143 core-s at the default (2-core AMD EPYC, 2026-11-28); level 1 took 1005 s. Subprocesses the tests
# start inherit it. tests/test_compile_level.py checks the model's forward and gradient against level 3.
SUITE_OPT_LEVEL = 0
