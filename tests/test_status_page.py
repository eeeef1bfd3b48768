"""The status page of a real peer in a real browser: headless Chromium driven by selenium logs in with
the form, and the session rows and the throughput chart render. CI installs Chromium and its driver
(.ci/run); there a missing browser fails the test instead of skipping it.

``EMBER_STATUS_SCREENSHOT=docs/status-page.png`` saves the page there (the README's picture), after
letting the chart fill in for half a minute."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

import ember as em

from .peers import Peer

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-9876543210", "admin-token-5555555555"
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1100,900")


def _chromium(profile_dir):
    """A headless Chromium under selenium, or a skip (a failure under CI) naming what is missing."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium")
    if missing:
        assert not os.environ.get("CI"), f"CI installs {', '.join(missing)}: the status page must be tested there"
        pytest.skip(f"not installed: {', '.join(missing)} (apt install chromium chromium-driver; pip install selenium)")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium's manager: look nothing up, the driver is named below
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*BROWSER_FLAGS, f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))


def page(browser) -> dict:
    """What the page shows now: its session rows (cell texts), the ops line's points, the errors, the summary."""
    return browser.execute_script("""
        const text = (id) => document.getElementById(id).textContent;
        const line = document.querySelector("#chart polyline.ops");
        return {rows: [...document.querySelectorAll("#sessions tbody tr")].map((r) => [...r.cells].map((c) => c.textContent)),
                points: line ? line.getAttribute("points") : "", errors: text("errors"), summary: text("summary"),
                login: !document.getElementById("login").hidden};""")


def test_the_status_page_shows_sessions_and_throughput(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    screenshot = os.environ.get("EMBER_STATUS_SCREENSHOT")
    (tmp_path / "tokens").write_text(f"alice {ALICE}\nbob {BOB}\nops {ADMIN} role=admin\n")  # ops sees every session
    stop = threading.Event()
    with Peer("--tokens-file", str(tmp_path / "tokens")) as peer:
        alice, bob = em.device(peer.url(token=ALICE)), em.device(peer.url("ws", token=BOB))
        x = em.asarray(np.random.default_rng(0).random((256, 256)), device=alice)
        with pytest.raises(em.ExecutionError, match="Singular"):
            em.asnumpy(em.linalg.inv(em.zeros((3, 3), device=bob)))
        steps = []

        def work():  # alice keeps the peer busy while the page watches
            while not stop.is_set():
                steps.append(float(em.sum(em.tanh(x @ x.mT / 256.0))))

        browser = _chromium(tmp_path / "chromium")  # first: a skip here leaves no worker running into the peer's stop
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            browser.get(f"http://{peer.address}/")
            wait = WebDriverWait(browser, 30)
            wait.until(lambda b: page(b)["login"])
            assert "sessions" not in page(browser)["summary"]  # no data before the token
            browser.find_element(By.ID, "token").send_keys(ADMIN)
            browser.find_element(By.CSS_SELECTOR, "#login button").click()
            # the page redraws itself: each look reads it whole, in one script
            state = WebDriverWait(browser, 60 if screenshot else 30).until(
                lambda b: (state := page(b)) and len(state["rows"]) == 2 and
                len(state["points"].split()) >= (15 if screenshot else 2) and state)
            assert all(len(p.split(",")) == 2 and all(float(v) >= 0 for v in p.split(",")) for p in state["points"].split())
            rows = {row[0]: row for row in state["rows"]}
            assert set(rows) == {"alice", "bob"}
            client, address, device, age, tensors, live, ops, trips, error = rows["alice"]
            assert address.startswith("127.0.0.1:") and device == "numpy" and int(ops) > 0 and int(trips) > 0
            assert live.endswith(("KiB", "MiB")) and error == ""
            assert rows["bob"][-1].startswith("ExecutionError: inv: Singular matrix")
            assert "Singular matrix" in state["errors"] and "numpy (numpy)" in state["summary"]
            assert ALICE not in browser.page_source and BOB not in browser.page_source and ADMIN not in browser.page_source
            path = screenshot or tmp_path / "status-page.png"
            assert browser.save_screenshot(str(path))
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        finally:
            stop.set()
            browser.quit()
            worker.join(30)
        assert steps and not worker.is_alive()
