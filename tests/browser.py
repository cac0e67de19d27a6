"""Debian's headless Chromium driven from Python (selenium with Debian's /usr/bin/chromedriver; no
browser or driver is downloaded), for tests that look at the MLflow UI as a user does.

    with chromium(tmp_path / "profile") as browser:
        browser.get(url)
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# headless, no sandbox (root in CI), nothing that reaches out to the network or needs a GPU
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1600,1000"]


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if absent:
        return (f"{', '.join(absent)} absent: `apt-get install -y chromium chromium-driver` "
                "(Debian's packages; .ci/run installs them as root)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed: scripts/install.sh --test"
    return None


@contextlib.contextmanager
def chromium(profile: Path, auth: tuple[str, str] | None = None):
    """A fresh browser with its own --user-data-dir, quit (driver and browser) at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    if auth is not None:  # a server behind basic auth (compose's MLflow): every request carries the login
        import base64

        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)
