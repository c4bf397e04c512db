# Sourced by the scripts/gpu/*_check.sh device scripts: the carried binaries, an output and a
# work folder, the device line, and gen PRESET (a generated bf16 checkpoint in $W/PRESET).
# Expects OUT and W set by the caller.
H=.gpu/harrier
T=.gpu/harrier-cuda-tool
mkdir -p "$OUT" "$W"
export HARRIER_HOME="$W/home"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

gen() { # preset
    [[ -f "$W/$1/config.json" ]] || "$H" gen-model --preset "$1" --out "$W/$1" --dtype bf16 --no-tokenizer >/dev/null 2>>"$OUT/gen.log" || echo "gen-model $1 failed" >&2
}
