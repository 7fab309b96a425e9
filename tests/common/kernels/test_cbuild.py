"""The C kernels' build: cache key, ISA level choice, PDSERVE_CPU_ISA, and every level the host
runs against the torch references (common/kernels/cbuild.py, common/kernels/isa.py)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.kernels import cbuild, cpu_attention, cpu_dense, cpu_layer, cpu_ops, cpu_quant, isa

ROOT = Path(__file__).resolve().parents[3]
COMPILER = cbuild.find_compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")

AVX2_HOST = frozenset("fpu sse2 avx avx2 fma f16c".split())
AVX512_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}

# which macros the compile defined: each level's code reports itself
PROBE = """
int level(void) {
#if defined(__AVX512VNNI__)
    return 4;
#elif defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__)
    return 2;
#else
    return 1;
#endif
}
"""


def names(levels: list[isa.Level]) -> list[str]:
    return [lv.name for lv in levels]


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def test_cpu_flags_come_from_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nprocessor\t: 1\nflags\t: x\n")
    assert isa.cpu_flags(str(info)) == {"fpu", "avx2", "fma"}
    assert isa.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_plain_c_gets_the_vector_levels_the_cpu_runs(x86):
    plain = lambda lv: isa.used_by(lv, ["int f(void) { return 0; }"])  # noqa: E731
    assert names(isa.candidates(plain, AVX2_HOST, "")) == ["avx2", "portable"]
    assert names(isa.candidates(plain, AVX512_HOST, "")) == ["avx512", "avx2", "portable"]
    assert names(isa.candidates(plain, frozenset(), "")) == ["portable"]


def test_vnni_and_bf16_levels_only_for_sources_with_code_for_them(x86):
    vnni = lambda lv: isa.used_by(lv, ["#ifdef __AVX512VNNI__\n#endif"])  # noqa: E731
    assert names(isa.candidates(vnni, AVX512_HOST, ""))[0] == "avx512vnni"
    assert names(isa.candidates(vnni, AVX2_HOST, ""))[0] == "avx2"
    elif_ = lambda lv: isa.used_by(lv, ["#if X\n#elif defined(__AVX512VNNI__)\n#endif"])  # noqa: E731
    assert names(isa.candidates(elif_, AVX512_HOST, ""))[0] == "avx512vnni"
    comment = lambda lv: isa.used_by(lv, ["/* no __AVX512VNNI__ code here */"])  # noqa: E731
    assert names(isa.candidates(comment, AVX512_HOST, ""))[0] == "avx512"
    bf16 = lambda lv: isa.used_by(lv, ["#if defined(__AVX512BF16__)\n#endif"])  # noqa: E731
    assert names(isa.candidates(bf16, AVX512_HOST, ""))[0] == "avx512"  # this CPU has no BF16
    assert names(isa.candidates(bf16, AVX512_HOST | {"avx512_bf16"}, ""))[0] == "avx512bf16"


def test_the_override_caps_the_level(x86, monkeypatch, caplog):
    plain = lambda lv: True  # noqa: E731
    assert names(isa.candidates(plain, AVX512_HOST, "avx2")) == ["avx2", "portable"]
    assert names(isa.candidates(plain, AVX512_HOST, "portable")) == ["portable"]
    # avxvnni sits below avx512: a cap there, on a CPU without AVX-VNNI, gives avx2
    assert names(isa.candidates(plain, AVX512_HOST, "avxvnni"))[0] == "avx2"
    # above the CPU: a warning, then the CPU's highest
    monkeypatch.setenv(isa.ENV, "avx512")
    with caplog.at_level(logging.WARNING, logger=isa.__name__):
        assert names(isa.candidates(plain, AVX2_HOST))[0] == "avx2"
    assert "PDSERVE_CPU_ISA=avx512: this CPU lacks" in caplog.text
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA='avx1024': expected one of portable"):
        isa.candidates(plain, AVX512_HOST)


def test_off_x86_only_portable(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert names(isa.candidates(lambda lv: True, AVX512_HOST, "")) == ["portable"]
    assert isa.compile_flags(isa.LEVELS[0]) == []


@needs_compiler
def test_build_key_ignores_the_host_name_and_follows_compiler_flags_and_sources(
    tmp_path, monkeypatch
):
    source, header = tmp_path / "k.c", tmp_path / "k.h"
    source.write_text(PROBE)
    header.write_text("/* shared */\n")
    cmds = [[COMPILER, "-c", "-O3", "-mavx2"]]

    def key(cmds=cmds):
        return cbuild.build_key(COMPILER, cmds, [source])

    first = key()
    for host in ("alpha", "beta"):
        monkeypatch.setattr(platform, "node", lambda host=host: host)
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        assert key() == first
    assert key([[COMPILER, "-c", "-O2", "-mavx2"]]) != first
    header.write_text("/* changed */\n")
    assert key() != first
    header.write_text("/* shared */\n")
    assert key() == first
    source.write_text(PROBE + "\n")
    assert key() != first
    source.write_text(PROBE)
    monkeypatch.setattr(cbuild, "compiler_identity", lambda cc: b"gcc (other) 99.0")
    assert key() != first


@needs_compiler
def test_a_shared_cache_never_hands_a_cpu_a_level_it_lacks(tmp_path, monkeypatch, caplog):
    """An AVX-512 host and an AVX2 host share one cache: each loads its own level's file, and
    -march=native in the caller's flags is dropped (here it would have meant AVX-512 code)."""
    # the probe's code is a constant return either way: any x86 CPU runs both builds
    vnni_flags = tuple(isa.compile_flags(isa.BY_NAME["avx512vnni"]))
    if not isa.is_x86() or not cbuild.accepts(COMPILER, vnni_flags):
        pytest.skip("needs an x86 compiler that knows -mavx512vnni")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(isa.ENV, raising=False)
    source = tmp_path / "probe.c"
    source.write_text(PROBE)

    def load(flags, cpu):
        monkeypatch.setattr(isa, "cpu_flags", lambda path="/proc/cpuinfo": cpu)
        lib, level = cbuild.build([(source, flags)], "the probe")
        lib.level.restype = ctypes.c_int
        return lib.level(), level, Path(lib._name).name

    big = load(["-O2"], AVX512_HOST)
    assert big[:2] == (4, "avx512vnni") and big[2].startswith("probe-avx512vnni-")
    with caplog.at_level(logging.WARNING, logger=cbuild.__name__):
        small = load(["-O2", "-march=native"], AVX2_HOST)
    assert small[:2] == (2, "avx2") and small[2].startswith("probe-avx2-")
    assert "dropping -march/-mtune=native" in caplog.text
    assert sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir()) == sorted(
        [big[2], small[2]]
    )


# The kernels' reference tests, at a forced level in a fresh process. What needs a tiny engine,
# the default model or a fresh cache (slow, and not per kernel) runs at the default level only;
# the a8 path's library (cpu_qgemm) checks each of its levels in test_cpu_qgemm.py, the prefill
# attention's (cpu_prefill) in test_cpu_prefill.py.
LIBRARIES = {
    "paged_decode": cpu_attention._LIB,
    "fused_ops": cpu_ops._LIB,
    "quant_matmul": cpu_quant._LIB,
    "dense_amx": cpu_dense._LIB,
    "decode_layer": cpu_layer._LIB,
}
# Each library's reference tests. decode_layer links the other three's sources, each compiled at
# the level it gets alone: where only its build is new, the parts' code in it is what their own
# tests ran at a lower level or at the default one, so its tests alone run there.
REFERENCE_TESTS = {
    "paged_decode": "tests/common/kernels/test_cpu_attention.py",
    "fused_ops": "tests/common/kernels/test_cpu_ops.py",
    "quant_matmul": "tests/common/model/test_quant.py",
    "dense_amx": "tests/common/kernels/test_cpu_dense.py",
    "decode_layer": "tests/common/kernels/test_cpu_layer.py",
}
SELECT = (
    "not float_mode and not model_forward and not engine and not run_batch and not default_model"
    " and not handoff and not int4pack] and not int8pack] and not dequant] and not a8]"
    " and not (per_op_path and (mistral or rope-scaled or qwen2))"
    # the team's matrix once per level: its C parts are the level's kernels, tested above
    " and not (the_team_gives and not llama-int4-float32]) and not never_spins"
    " and not (the_team_merges and not auto-float32])"
)
CHILD = """
import json, sys
import pytest
from common.kernels import cpu_attention, cpu_dense, cpu_layer, cpu_ops, cpu_quant
libs = [cpu_attention._LIB, cpu_ops._LIB, cpu_quant._LIB, cpu_dense._LIB, cpu_layer._LIB]
assert all(lib.available() for lib in libs)
print(json.dumps({lib.source.stem: [lib.level, lib.lib._name] for lib in libs}), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", "-k", sys.argv[1], *sys.argv[2:]]))
"""
# one library's build at the level $PDSERVE_CPU_ISA gives it; cbuild alone, without torch
BUILD = """
import json, sys
from pathlib import Path
from common.kernels import cbuild
lib, level = cbuild.build([(Path(p), flags) for p, flags in json.loads(sys.argv[1])], sys.argv[2])
assert lib is not None, "the build failed"
print(json.dumps([level, Path(lib._name).name]))
"""


def expected_levels(value: str) -> dict[str, str]:
    """Each library's level under PDSERVE_CPU_ISA=value: the highest of its units' levels."""
    out = {}
    for stem, lib in LIBRARIES.items():
        units = [lib.source, *(path for path, _ in lib.parts)]
        texts = [p.read_text() for u in units for p in (u, *cbuild.headers(u))]
        out[stem] = isa.candidates(lambda lv, t=texts: isa.used_by(lv, t), value=value)[0].name
    return out


def forced_runs() -> dict[str, list[str]]:
    """The levels worth a run here, each with the libraries whose tests it runs: the host runs
    the level, and those libraries load another build there than at the default level (the rest
    of the suite) or at a lower forced level."""
    seen = set(expected_levels("").items())
    runs = {}
    for level in isa.LEVELS:
        if isa.runs(level):
            builds = expected_levels(level.name).items()
            if new := [stem for stem, lv in builds if (stem, lv) not in seen]:
                runs[level.name] = new
            seen.update(builds)
    return runs


FORCED = forced_runs()
LEVELS = {level: expected_levels(level) for level in FORCED}


def build_at(level: str, stem: str) -> str:
    """Build one library as a run at PDSERVE_CPU_ISA=level would (cbuild alone, in a fresh
    process, without torch); its file name."""
    lib = LIBRARIES[stem]
    units = json.dumps([(str(lib.source), lib.flags), *((str(p), f) for p, f in lib.parts)])
    out = subprocess.run(
        [sys.executable, "-c", BUILD, units, stem], env={**os.environ, isa.ENV: level}, cwd=ROOT,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    built_level, name = json.loads(out.stdout)
    assert built_level == LEVELS[level][stem]
    return name


def run_at(level: str) -> subprocess.CompletedProcess:
    """The reference tests of the libraries with a new build at `level`, in a fresh process."""
    tests = [REFERENCE_TESTS[stem] for stem in FORCED[level]]
    return subprocess.run(
        [sys.executable, "-c", CHILD, SELECT, *tests],
        env={**os.environ, isa.ENV: level}, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def forced(request) -> dict[str, tuple[dict[str, str], subprocess.CompletedProcess]]:
    """Each selected level's builds and its run, as many at a time as the host has cores: a build
    compiles its sources one after another, and a run's tests are mostly one thread of Python.
    Every distinct build is made once, before the runs, so no two runs build the same file.
    {level: ({library: file name}, the run)}."""
    selected = [
        item.callspec.params["level"]
        for item in request.session.items
        if item.originalname == "test_kernels_at_each_level_the_host_runs_match_torch"
    ]
    builds = {(stem, lv): level for level in selected for stem, lv in LEVELS[level].items()}
    # the libraries with the most to compile first (decode_layer links all four sources)
    order = sorted(builds, key=lambda build: len(LIBRARIES[build[0]].parts), reverse=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        names = dict(zip(order, pool.map(lambda build: build_at(builds[build], build[0]), order)))
        runs = dict(zip(selected, pool.map(run_at, selected)))
    return {
        level: ({stem: names[stem, lv] for stem, lv in LEVELS[level].items()}, runs[level])
        for level in selected
    }


@needs_compiler
@pytest.mark.skipif(bool(os.environ.get(isa.ENV)), reason="PDSERVE_CPU_ISA set for the suite")
@pytest.mark.parametrize("level", list(FORCED) or [None])
@pytest.mark.timeout(900)  # the first one's setup builds and runs every level
def test_kernels_at_each_level_the_host_runs_match_torch(level, request):
    if level is None:
        pytest.skip("the host runs no level but the default one")
    built, out = request.getfixturevalue("forced")[level]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    loaded = json.loads(out.stdout.splitlines()[0])
    # every library loads at the level, the very build made above (so none was built again)
    assert {stem: lv for stem, (lv, _) in loaded.items()} == LEVELS[level]
    assert {stem: Path(path).name for stem, (_, path) in loaded.items()} == built
    assert all(f"-{lv}-" in Path(path).name for lv, path in loaded.values())
    assert " passed" in out.stdout and " failed" not in out.stdout


@needs_compiler
def test_the_libraries_log_their_level(caplog):
    with caplog.at_level(logging.INFO, logger=cbuild.__name__):
        fresh = cbuild.CLibrary(cpu_ops._SOURCE, cpu_ops._FLAGS, {}, "the fused CPU ops")
        assert fresh.available()
    assert fresh.level == expected_levels(os.environ.get(isa.ENV, ""))["fused_ops"]
    assert f"fused_ops.c loaded, ISA level {fresh.level}" in caplog.text
