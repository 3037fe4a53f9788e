"""Hypothesis profiles: ``fast`` by default (a quick local run), ``thorough`` under ``CI=true`` (what CI sets),
with more examples and longer stateful runs. Where Hypothesis is not installed (the offline GPU check)
nothing is registered: the GPU tests do not use it."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import HealthCheck, settings

    settings.register_profile("fast", max_examples=30, stateful_step_count=25, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", max_examples=200, stateful_step_count=50, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("thorough" if os.environ.get("CI") == "true" else "fast")


@pytest.fixture(scope="session")
def avx2_kernels():
    """The compiled CPU kernels with their AVX2 path (``small_linear``, ``coded_linear``), built once for the
    session; the test is skipped where they do not build or the CPU lacks AVX2."""
    from radixkv.cpu.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels

    if reason := cpu_kernels_unavailable_reason():
        pytest.skip(f"CPU kernels unavailable: {reason}")
    from radixkv.cpu.capabilities import cpu_capabilities

    if not cpu_capabilities().avx2:
        pytest.skip(f"small_linear and coded_linear are AVX2 kernels; this CPU: {cpu_capabilities().isa}")
    return load_cpu_kernels()
