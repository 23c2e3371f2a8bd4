# Sourced by the native build scripts (tests/native/build_gated.sh, bench/native/build_mainloop.sh):
# sets CUTLASS_PATH to a CUTLASS tree holding include/ and tools/util/include/ — the caller's
# CUTLASS_PATH when set, else .cutlass/ when it holds the headers, else those of the installed
# nvidia-cutlass package (cutlass_library) — and stops when none holds cutlass/cutlass.h.
if [ -z "${CUTLASS_PATH:-}" ]; then
  if [ -f .cutlass/include/cutlass/cutlass.h ]; then
    CUTLASS_PATH=$PWD/.cutlass
  else
    CUTLASS_PATH=$(${PYTHON:-python3} -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')
  fi
fi
[ -f "$CUTLASS_PATH/include/cutlass/cutlass.h" ] || { echo "no CUTLASS headers under $CUTLASS_PATH" >&2; exit 2; }
