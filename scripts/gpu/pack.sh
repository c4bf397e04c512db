#!/usr/bin/env bash
# Packs a device call's carry on the development machine (no GPU needed): the stripped
# harrier and harrier-cuda-tool binaries and kernel cubins, xz'd into .gpu-z/ (git-ignored
# through .git/info/exclude), for scripts/gpu/binab.sh on the device.
#
#   scripts/gpu/pack.sh [NAME=DEFINES ...]
#     builds the release binaries (cuda feature), then `new.cubin` (the source's default
#     kernels) and one NAME.cubin a variant, e.g.
#       scripts/gpu/pack.sh nodep=-DRING_NO_DEP "h1=-DRING_DEPTH_HEAD=1 -DRING_BAR_CHECK"
#   OLD=REV also packs harrier-cuda-tool-old built at REV (a worktree under /tmp, its own
#   target folder: ~3 minutes) and old.cubin, REV's default kernels (where REV has
#   kernel_image.py), for binab.sh's "old" side of a structural change (O: the old tool on its
#   own cubin; the two builds' kernel parameters may differ, so never K on old.cubin).
#   .gpu-z/ is emptied first.
#
# Cubins come from scripts/gpu/kernel_image.py (NVRTC here, then ptxas; `scripts/setup.sh
# ptxas`, which this runs first, installs both when missing). Takes ~1.5 minutes a cubin and a
# few minutes for the binaries on 2 cores; check the carry stays under 64 MiB (du -sh .gpu-z).
set -euo pipefail
cd "$(dirname "$0")/../.."
die() {
    echo "pack: ERROR: $*" >&2
    exit 1
}

build_tools() { # the device tool and the server binary (for gen-model)
    cargo build --release -p harrier-engine-core --features cuda --bin harrier-cuda-tool
    cargo build --release -p harrier-frontend --bin harrier
}

pack() { # SRC DEST-NAME
    strip -o "/tmp/pack-$2" "$1"
    xz -6 -T2 -c "/tmp/pack-$2" >".gpu-z/$2.xz"
    rm -f "/tmp/pack-$2"
}

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '.gpu-z/' "$exclude" 2>/dev/null || echo '.gpu-z/' >>"$exclude"
for spec in "$@"; do # (checked before a minute of building)
    name="${spec%%=*}"
    [[ "$spec" == *=* && "$name" =~ ^[A-Za-z0-9_-]+$ && "$name" != new && "$name" != old ]] \
        || die "variant '$spec': NAME=DEFINES, NAME in letters, digits, - and _, not 'new' or 'old'"
done
rm -rf .gpu-z && mkdir .gpu-z # (nothing of an earlier pack travels with this one)
scripts/setup.sh ptxas # (NVRTC and ptxas for the cubins; a no-op once there)
build_tools
pack target/release/harrier-cuda-tool harrier-cuda-tool
pack target/release/harrier harrier
if [[ -n "${OLD:-}" ]]; then
    wt=/tmp/harrier-pack-old
    old_target=/tmp/harrier-pack-old-target # (kept: a later pack at the same REV builds fast)
    rm -rf "$wt" && git worktree prune && git worktree add -q --detach "$wt" "$OLD"
    (cd "$wt" && cargo build --release -p harrier-engine-core --features cuda --bin harrier-cuda-tool \
        --target-dir "$old_target")
    pack "$old_target/release/harrier-cuda-tool" harrier-cuda-tool-old
    if [[ -f "$wt/scripts/gpu/kernel_image.py" ]]; then # (REV's own source and options)
        python3 "$wt/scripts/gpu/kernel_image.py" "$old_target/old.cubin"
        xz -6 -c "$old_target/old.cubin" >.gpu-z/old.cubin.xz
    else
        echo "pack: $OLD has no scripts/gpu/kernel_image.py: no old.cubin (O would compile with NVRTC)" >&2
    fi
    git worktree remove --force "$wt"
fi
cubins="$(mktemp -d)"
for spec in "new=" "$@"; do
    name="${spec%%=*}"
    # shellcheck disable=SC2086 # (the defines split on spaces)
    python3 scripts/gpu/kernel_image.py "$cubins/$name.cubin" ${spec#*=}
    xz -6 -c "$cubins/$name.cubin" >".gpu-z/$name.cubin.xz"
done
rm -rf "$cubins"
du -sh .gpu-z
