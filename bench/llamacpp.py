"""This engine against llama.cpp on the same GGUF files, one CPU thread.

    python -m bench.llamacpp --build                  # once: builds llama.cpp (about 10 min, one core)
    python -m bench.llamacpp                          # qwen-coder: 6 HumanEval + 4 prose prompts, 64 tokens
    python -m bench.llamacpp --weights int4 --code 2 --prose 1
    python -m bench.llamacpp --pair smollm2 --fixed ngram-k4   # no draft GGUF: no llama-speculative
    python -m bench.llamacpp --weights int8,int8/int4-pure --llama lookup   # the draft in its own mode
    python -m bench.llamacpp --build --isa avx2 && python -m bench.llamacpp --isa avx2   # as on an AVX2 CPU
    python -m bench.llamacpp --build-server           # llama-server too, for python -m bench.serve --llama-server

``--build`` downloads the llama-cpp-python 0.3.36 source (``pip download --no-binary :all:``),
takes the llama.cpp it vendors and builds ``llama-completion``, ``llama-speculative`` and
``llama-lookup`` with one job into ``<cache root>/llama.cpp-0.3.36`` (``rakv.model_files``),
outside the repository; ``--build-server`` builds ``llama-server`` into the same directory
(sharing the library's objects with the tools). Tests never build it.

Then, in lockstep (each prompt under every configuration before the next prompt), one
thread each:
- llama.cpp plain greedy (``llama-completion``), its draft-model speculation
  (``llama-speculative``) at its default draft maximum (3) and at 2, 4, 8 and 16, and
  its prompt lookup (``llama-lookup``);
- this engine's ``ar``, fixed policies and ``rakv``, in each ``--weights`` mode.

Figures are tokens per second with the prompt included: new tokens over the time from
the prompt to the last token. llama.cpp's times are its own printed prompt and generation
times (model loading excluded); the engine's are wall times. It prints the ratios to
llama.cpp plain greedy and to llama.cpp's best speculative setting, and whether each
llama.cpp output equals llama.cpp's own greedy output (its arithmetic depends on the
batch size, so its speculation is not always exact), and whether each of the engine's
equals its ``ar`` output in the target's mode (plain greedy of the same weights: always,
or the engine is wrong). Beside each, the prompt's rate:
prompt tokens over llama.cpp's prompt eval (or encode) time, or over the engine's time to
its first token (prefill, the draft's included, and the decision).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"
GGUFS = {"qwen-coder": ("qwen-coder-1.5b", "qwen-coder-0.5b"), "smollm2": ("smollm2", None)}  # target, draft
BINARIES = ("llama-completion", "llama-speculative", "llama-lookup")
SERVER = "llama-server"  # built by --build-server, run by bench.serve --llama-server (bench.llama_server)
LLAMA_TOOLS = {"lookup": "llama-lookup", "speculative": "llama-speculative"}  # --llama's names
DRAFT_MAX = (2, 4, 8, 16)  # llama-speculative's --spec-draft-n-max values tried besides its default (3)
CPU_ONLY = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
            "-DGGML_OPENMP=OFF", "-DBUILD_SHARED_LIBS=OFF",
            # Not GGML_NATIVE: on this machine it also compiles ggml's AMX path, which dies of
            # SIGILL at its first tile instruction; the x86 flags the CPU has, AMX left out.
            "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
# The server's targets are configured (so --build and --build-server share one configuration
# and neither rebuilds the other's objects); only the targets asked for are built.
GENERATOR = "Unix Makefiles"  # not Ninja: on this machine it looped on "manifest still dirty"
# /proc/cpuinfo flag -> ggml's CMake option, turned on where the CPU has the flag
NATIVE, AVX2 = "native", "avx2"  # --isa: the CPU's own features, or AVX2's alone (an AVX2 CPU on a newer one)
AVX2_FLAGS = {"avx", "avx2", "fma", "f16c"}
X86_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
               "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
               "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_options(isa: str = NATIVE) -> list[str]:
    """``-DGGML_<X>=ON|OFF`` for each x86 feature ggml can use, from /proc/cpuinfo (for
    ``--isa avx2`` only AVX2's: AVX, AVX2, FMA, F16C)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ["-DGGML_NATIVE=ON"]  # not Linux: let the compiler detect the CPU
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    if isa == AVX2:
        flags &= AVX2_FLAGS
    return [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_OPTIONS.items()]


def build_root() -> Path:
    from rakv.model_files import cache_root
    return cache_root() / f"llama.cpp-{VERSION}"


def binary(name: str, isa: str = NATIVE) -> Path:
    return build_root() / ("build" if isa == NATIVE else f"build-{isa}") / "bin" / name


def cap_at_avx2() -> None:
    """This process's kernels as an AVX2 CPU runs them: the project's (RAKV_KERNEL_PATH),
    torch's (ATEN_CPU_CAPABILITY) and oneDNN's, fp32's Linear layers (ONEDNN_MAX_CPU_ISA).
    Before torch is imported: it reads them once."""
    import os
    os.environ["RAKV_KERNEL_PATH"] = "avx2"
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"


def configure_command(source: Path, out: Path, isa: str = NATIVE) -> list[str]:
    """CMake's configure step; the generator only for a new build directory (CMake refuses
    to change the generator of an existing one)."""
    generator = [] if (out / "CMakeCache.txt").is_file() else ["-G", GENERATOR]
    return ["cmake", "-S", str(source), "-B", str(out), *generator, *CPU_ONLY, *cpu_options(isa)]


def build(jobs: int = 1, isa: str = NATIVE, targets: tuple[str, ...] = BINARIES) -> None:
    """Download the sdist, extract its vendored llama.cpp, build ``targets`` (the three
    tools, or ``(SERVER,)``)."""
    root = build_root()
    source = root / "src"
    if not (source / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            print(f"downloading llama-cpp-python=={VERSION} (source)", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={VERSION}", "-d", tmp, "-q"], check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            partial = root / "src.partial"
            shutil.rmtree(partial, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for m in members:
                    m.name = m.name[len(prefix):]
                tar.extractall(partial, members=members, filter="data")
            partial.replace(source)
    out = binary(targets[0], isa).parent.parent
    print(f"building {', '.join(targets)} in {out} with {jobs} job(s): 10-15 min on one core", file=sys.stderr)
    subprocess.run(configure_command(source, out, isa), check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *targets], check=True)
    missing = [name for name in targets if not binary(name, isa).is_file()]
    if missing:
        raise OSError(f"the build made no {', '.join(missing)}")
    print(f"built: {binary(targets[0], isa).parent}", file=sys.stderr)


@dataclass(frozen=True)
class Run:
    """One request: new tokens, seconds from the prompt to the last token, the output, and
    the prompt's tokens and seconds (to the first new token's logits)."""

    num_tokens: int
    seconds: float
    text: str
    num_prompt_tokens: int
    prompt_s: float
    system_info: str = ""  # llama.cpp's line of the CPU features its build uses


def _timing_s(pattern: str, log: str) -> float:
    found = re.findall(pattern, log)
    if not found:
        raise OSError(f"llama.cpp printed no timing matching {pattern!r}; log tail: {log[-400:]!r}")
    return float(found[-1]) / 1e3


def llama_run(tool: str, target: Path, draft: Path | None, prompt: str, num_tokens: int,
              extra: tuple[str, ...] = (), isa: str = NATIVE) -> Run:
    """Run one llama.cpp tool greedily on one thread; its own prompt + generation time."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    args = [str(binary(tool, isa)), "-m", str(target), "-f", f.name, "-n", str(num_tokens), "-t", "1", "-tb", "1",
            "--temp", "0", "--top-k", "1", "--seed", "0", "-c", "2048", "--ignore-eos", *extra]
    if tool == "llama-completion":
        args += ["-no-cnv", "--no-display-prompt"]
    if draft is not None:
        args += ["-md", str(draft), "--threads-draft", "1"]
    done = subprocess.run(args, capture_output=True, text=True)
    Path(f.name).unlink()
    if done.returncode:
        raise OSError(f"{tool} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    log = done.stderr
    if tool == "llama-completion":
        prompt = re.findall(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", log)
        if not prompt:
            raise OSError(f"llama.cpp printed no prompt eval timing; log tail: {log[-400:]!r}")
        prompt_s, num_prompt_tokens = float(prompt[-1][0]) / 1e3, int(prompt[-1][1])
        seconds = prompt_s + _timing_s(r"\beval time =\s+([\d.]+) ms", log)
        text = done.stdout
    else:  # speculative and lookup print "encoded N tokens in X seconds" and "decoded N tokens in Y seconds";
        # they may decode past -n (an accepted draft's tail), so the count is theirs, and they echo the prompt
        encoded = re.findall(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        decoded = re.findall(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if not encoded or not decoded:
            raise OSError(f"{tool} printed no encode/decode timing; log tail: {log[-400:]!r}")
        num_prompt_tokens, prompt_s = int(encoded[-1][0]), float(encoded[-1][1])
        seconds = prompt_s + float(decoded[-1][1])
        num_tokens = int(decoded[-1][0])
        at = done.stdout.find(prompt)
        text = done.stdout[at + len(prompt):] if at >= 0 else done.stdout
    info = re.findall(r"system_info:(.*)", log)
    return Run(num_tokens, seconds, text, num_prompt_tokens, prompt_s, info[-1].strip() if info else "")


def engine_run(engine, prompt_ids: list[int], num_tokens: int, pair) -> Run:
    start = time.perf_counter()
    result = engine.generate(prompt_ids, num_tokens)
    return Run(len(result.output_ids), time.perf_counter() - start, pair.decode(list(result.output_ids)),
               len(prompt_ids), result.ttft_s)


@dataclass
class Tally:
    runs: dict[str, list[Run]] = field(default_factory=dict)

    def add(self, name: str, run: Run) -> None:
        self.runs.setdefault(name, []).append(run)

    def tokens_per_s(self, name: str) -> float:
        runs = self.runs[name]
        return sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs)

    def prompt_tokens_per_s(self, name: str) -> float:
        runs = self.runs[name]
        return sum(r.num_prompt_tokens for r in runs) / sum(r.prompt_s for r in runs)


def bench(args) -> int:
    import torch
    torch.set_num_threads(1)
    from bench.assisted import workloads
    from bench.harness import fresh_engine
    from rakv import kernels, model_files
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    missing = [name for name in BINARIES if not binary(name, args.isa).is_file()]
    if missing:
        build_command = "python -m bench.llamacpp --build" + ("" if args.isa == NATIVE else f" --isa {args.isa}")
        raise OSError(f"llama.cpp is not built ({missing[0]} missing): run {build_command}")
    target, draft = (None if name is None else model_files.resolve(name) for name in GGUFS[args.pair])
    modes = args.weights.split(",")
    pairs = {mode: load_pair(args.pair, weights_mode=mode) for mode in modes}
    engines = {}
    for mode, pair in pairs.items():
        timings = load_or_calibrate(pair)
        for policy in ["ar", *args.fixed.split(","), "rakv"]:
            engines[f"rakv engine {policy} ({mode})"] = (pair, fresh_engine(pair, policy, timings=timings
                                                                                  if policy == "rakv" else None))
    prompts = workloads(pairs[modes[0]], args.code, args.prose)
    llama = {"llama.cpp greedy": ("llama-completion", None, ()),
             "llama.cpp lookup": ("llama-lookup", None, ()),
             "llama.cpp speculative (default)": ("llama-speculative", draft, ())}
    llama |= {f"llama.cpp speculative draft max {n}": ("llama-speculative", draft, ("--spec-draft-n-max", str(n)))
              for n in DRAFT_MAX}
    tools = {"llama-completion"} | {LLAMA_TOOLS[name] for name in args.llama.split(",") if name}
    if draft is None:  # a layer-prefix draft has no file of its own
        tools.discard("llama-speculative")
    llama = {name: run for name, run in llama.items() if run[0] in tools}
    tallies = {workload: Tally() for workload in prompts}
    exact = {name: 0 for name in llama if name != "llama.cpp greedy"}
    engine_exact = {name: 0 for name in engines}  # outputs equal to the target mode's ``ar`` output
    start, llama_info = time.perf_counter(), ""
    for workload, prompt_list in prompts.items():
        for i, ids in enumerate(prompt_list):
            text = pairs[modes[0]].decode(ids)
            greedy = None
            for name, (tool, drafter, extra) in llama.items():
                run = llama_run(tool, target, drafter, text, args.max_new_tokens, extra, args.isa)
                if greedy is None:  # the first is plain greedy, the reference
                    greedy, llama_info = run.text, run.system_info
                else:  # a speculative tool may run past -n: its output must start with greedy's
                    exact[name] += run.text.strip().startswith(greedy.strip())
                tallies[workload].add(name, run)
            plain_output = {}  # target mode -> the output of ``ar`` in it (the first engine of a mode: plain greedy)
            for name, (pair, engine) in engines.items():
                run = engine_run(engine, ids, args.max_new_tokens, pair)
                target_mode = pair.weights.split("/")[0]  # a draft's mode never changes the output
                if plain_output.setdefault(target_mode, run.text) == run.text:
                    engine_exact[name] += 1
                tallies[workload].add(name, run)
            print(f"{workload} prompt {i + 1}/{len(prompt_list)} done ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr)
    num_prompts = sum(map(len, prompts.values()))
    print(f"{args.pair}, {args.max_new_tokens} new tokens, one thread, lockstep; tok/s with the prompt included")
    print(f"kernel paths: this engine's quantized modes {kernels.path_here()} (the CPU's fastest: "
          f"{kernels.PATHS[kernels.cpu_path()]}), its fp32 torch {torch.backends.cpu.get_cpu_capability()}; "
          f"llama.cpp {llama_info or '(printed no system_info)'}")
    for workload, tally in tallies.items():
        plain = tally.tokens_per_s("llama.cpp greedy")
        best_spec = max([n for n in llama if n != "llama.cpp greedy"] or ["llama.cpp greedy"], key=tally.tokens_per_s)
        print(f"{workload} ({len(prompts[workload])} prompts): llama.cpp greedy {plain:.2f} tok/s; its best "
              f"speculative setting: {best_spec} {tally.tokens_per_s(best_spec):.2f}")
        for name in tally.runs:
            rate = tally.tokens_per_s(name)
            same = f"   equals llama.cpp greedy on {exact[name]}/{num_prompts} prompts" if name in exact \
                else f"   equals the engine's ar on {engine_exact[name]}/{num_prompts} prompts" if name in engine_exact \
                else ""
            print(f"  {name:42} {rate:7.2f} tok/s  x{rate / plain:5.2f} llama.cpp greedy  "
                  f"x{rate / tally.tokens_per_s(best_spec):5.2f} its best speculative  "
                  f"prompt {tally.prompt_tokens_per_s(name):6.1f} tok/s{same}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rakv.weights import FP32, INT4, INT8
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pair", choices=sorted(GGUFS), default="qwen-coder")
    p.add_argument("--build", action="store_true", help="build llama.cpp (once, outside the repository) and exit")
    p.add_argument("--build-server", action="store_true",
                   help=f"build llama.cpp's {SERVER} (for python -m bench.serve --llama-server) and exit")
    p.add_argument("--jobs", type=int, default=1, help="build jobs (default: 1)")
    p.add_argument("--isa", choices=(NATIVE, AVX2), default=NATIVE,
                   help="native: llama.cpp built for this CPU's features, this engine on its fastest kernel path; "
                        "avx2: both as an AVX2 CPU runs them (llama.cpp built for AVX2 alone, into its own "
                        "directory; this engine's kernels, torch's and oneDNN's capped at AVX2), to measure an "
                        "AVX2 machine on a newer one (default: native)")
    p.add_argument("--code", type=int, default=6, help="HumanEval prompts (default: 6)")
    p.add_argument("--prose", type=int, default=4, help="prose prompts (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--weights", default=f"{FP32},{INT8},{INT4}",
                   help="the engine's modes, comma-separated (default: fp32,int8,int4)")
    p.add_argument("--fixed", default="spec-k4", help="fixed policies besides ar and rakv (default: spec-k4)")
    p.add_argument("--llama", default="lookup,speculative",
                   help="llama.cpp's speculative tools to run besides its plain greedy (always run: the "
                        "reference), comma-separated from lookup, speculative (its default draft maximum and "
                        f"{', '.join(map(str, DRAFT_MAX))}); empty for none (default: lookup,speculative)")
    args = p.parse_args(argv)
    unknown = set(filter(None, args.llama.split(","))) - LLAMA_TOOLS.keys()
    if unknown:
        p.error(f"--llama takes {', '.join(LLAMA_TOOLS)}; got {', '.join(sorted(unknown))}")
    try:
        if args.build or args.build_server:
            if args.build:
                build(args.jobs, args.isa)
            if args.build_server:
                build(args.jobs, args.isa, (SERVER,))
            return 0
        if args.isa == AVX2:
            cap_at_avx2()
        return bench(args)
    except (ValueError, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
