# Sourced by the set-up scripts that keep an environment of their own (setup_osworld.sh,
# setup_vllm.sh, setup_vllm_cpu.sh), after they define `say` and `die`.

# ensure_venv VENV PYTHON CHECK NAME: VENV exists, made with PYTHON, unless its own python passes
# CHECK (Python statements after `import sys` that fail on an unusable one: a wrong version). An
# unusable VENV is removed first, but only ever a virtual environment (NAME: the variable that
# chose VENV, named when it points at something else). VENV is kept out of git either way.
ensure_venv() {
  local venv="$1" py="$2" check="$3" name="$4"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import sys; $check" 2>/dev/null; then
    if [ -e "$venv" ]; then
      [ -f "$venv/pyvenv.cfg" ] || die "$venv exists and is not a virtual environment: refusing to touch it (check $name)"
      say "removing unusable $venv"; rm -rf "$venv"
    fi
    say "creating $venv with $py"
    "$py" -m venv "$venv"
  fi
  [ -f "$venv/.gitignore" ] || printf '*\n' > "$venv/.gitignore"
}
