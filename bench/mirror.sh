# bench/mirror.sh - sourced by the GPU scripts: copy a run's files into $OUT while it runs, so a call that the
# device tool stops at its limit (everything killed, no trap runs) still brings back what the run had written.
# On 2026-12-07 two calls returned nothing: their scripts copied the results into $OUT only at their end.
#
#   mirror_start DEST FILE_OR_GLOB...   every MIRROR_EVERY_S seconds (default 15), copy those that exist into DEST
#   mirror_stop                          stop the copier, after one last copy
#
# Globs are expanded at each copy (files that appear later are taken). One copier at a time.

MIRROR_PID=""

_mirror_once() {  # _mirror_once DEST PATTERN...
    local dest="$1" pat f
    shift
    for pat in "$@"; do
        for f in $pat; do  # unquoted on purpose: the pattern expands here
            [ -f "$f" ] && cp -f "$f" "$dest/" 2> /dev/null
        done
    done
    return 0
}

mirror_start() {
    local dest="$1"
    shift
    mkdir -p "$dest"
    mirror_stop
    MIRROR_ARGS=("$dest" "$@")
    (
        while true; do
            sleep "${MIRROR_EVERY_S:-15}"
            _mirror_once "$dest" "$@"
        done
    ) &
    MIRROR_PID=$!
}

mirror_stop() {
    if [ -n "$MIRROR_PID" ]; then
        kill "$MIRROR_PID" 2> /dev/null || true
        wait "$MIRROR_PID" 2> /dev/null || true  # 143: it ended by our TERM
        MIRROR_PID=""
        _mirror_once "${MIRROR_ARGS[@]}"
    fi
    return 0
}
