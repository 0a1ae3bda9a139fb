#!/usr/bin/env bash
# The SASS of the kernel instances whose mangled name contains PATTERN, from OBJECT, with a
# count of instructions by opcode (for instruction-diet work; needs cuobjdump, i.e. the GPU
# machine's toolkit).
#   scripts/sass_of.sh OBJECT PATTERN
set -euo pipefail
obj=$1
pattern=$2
dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$dump" -sass "$obj" | awk -v pat="$pattern" '
  /Function : / { keep = index($0, pat) > 0 }
  keep { print }'
echo "---- opcode counts"
"$dump" -sass "$obj" | awk -v pat="$pattern" '
  /Function : / { keep = index($0, pat) > 0 }
  keep && /\/\*[0-9a-f]+\*\// {
    line = $0; sub(/.*\*\/ */, "", line); sub(/^@!?U?P[T0-9]+ */, "", line)
    split(line, f, /[ .;]/); if (f[1] != "") n[f[1]]++
  }
  END { for (op in n) printf "%6d %s\n", n[op], op }' | sort -rn
