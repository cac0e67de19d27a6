#!/usr/bin/env bash
# Rebuild .dvc/plots/offline.html, the page template `dvc plots show` uses (.dvc/config
# plots.html_template): DVC's own page with vega, vega-lite and vega-embed inlined, at the
# versions dvc-render's page loads from a CDN, so the plots render offline.
# Needs npm (the registry); run it again only when dvc-render's pinned versions change.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
versions=$(.venv/bin/python -c "
import re, dvc_render.vega as v
print(' '.join(re.findall(r'npm/(vega(?:-lite|-embed)?@[0-9.]+)', v.VegaRenderer.SCRIPTS)))")
(cd "$work" && npm pack --silent $versions >/dev/null)
mkdir -p .dvc/plots
.venv/bin/python - "$work" .dvc/plots/offline.html <<'PY'
import sys, tarfile
from pathlib import Path
from dvc_render.html import PAGE_HTML

work, out = Path(sys.argv[1]), Path(sys.argv[2])
scripts = []
for name in ("vega", "vega-lite", "vega-embed"):
    tgz = next(work.glob(f"{name}-[0-9]*.tgz"))
    with tarfile.open(tgz) as tar:
        js = tar.extractfile(f"package/build/{name}.min.js").read().decode()
        license = tar.extractfile("package/LICENSE").read().decode()
    assert "</script" not in js and "{plot_divs}" not in js, tgz.name
    scripts.append(f"<!-- {tgz.stem} (npm), its LICENSE:\n{license.replace('--', '- -')}-->\n<script>{js}</script>")
page = PAGE_HTML.replace("{scripts}", "\n".join(scripts))  # DVC's {scripts} would add the CDN links back
out.write_text(page, encoding="utf8")
print(f"{out}: {out.stat().st_size:,} bytes")
PY
