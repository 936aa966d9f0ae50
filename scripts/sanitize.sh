#!/usr/bin/env bash
# The C extension under AddressSanitizer and UBSan: build amesh._native._ext with setup.py's
# AMESH_EXT_DEBUG=1 into a copy of src/, then run the tests that drive it (transports,
# TLS, the wire format, refilled bytes) with that copy, the sanitizers' runtime preloaded (the
# interpreter itself is not instrumented). Any report fails the run. Run by
# scripts/test.sh after the setup; needs .venv (scripts/setup.sh) and gcc.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r src "$work/src"
rm -f "$work"/src/amesh/_native/_ext*.so
AMESH_EXT_DEBUG=1 python setup.py -q build_ext --build-temp "$work/build" --build-lib "$work/src" \
    > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }

asan=$(gcc -print-file-name=libasan.so)
if [ ! -e "$asan" ]; then
    echo "no libasan.so for this gcc: cannot run the sanitizer build" >&2
    exit 1
fi
so=$(ls "$work"/src/amesh/_native/_ext*.so)
symbols=$(nm -D "$so")  # (not piped into grep -q: pipefail would see nm's SIGPIPE)
grep -q __asan_report <<< "$symbols" || { echo "$so is not instrumented" >&2; exit 1; }
export PYTHONPATH="$work/src" LD_PRELOAD="$asan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
# the tests below import this build, and so do the workers they start
python -c "import amesh._native._ext as e, sys; sys.exit(e.__file__ != sys.argv[1])" "$so"
echo "== sanitizers: transport, TLS and wire tests with $so"
python -m pytest -q -p no:cacheprovider tests/test_transport.py tests/test_tls.py tests/test_wire.py \
    tests/test_properties_stream.py "$@"
echo "== sanitizers: large bytes out of shared memory (pread_bytes, copy_bytes)"
python -m pytest -q -p no:cacheprovider tests/test_codec.py -k "copy_bytes or spare or fill_an_object or mappings"
