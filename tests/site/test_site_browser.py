"""`assistant kb site` in a real headless Chromium: it renders, searches and links.

The site is served by http.server on 127.0.0.1 and driven by selenium through
Debian's chromium + chromium-driver (.ci/setup installs them). Skips, saying
why, only where those cannot be found.
"""

from __future__ import annotations

import functools
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest
from kbsite_hostile import HOSTILE_ID, HOSTILE_TITLE, REPO_KB, make_hostile_team

from assistant.knowledge.kb import load_kb
from assistant.site.build import build_site

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
WAIT_S = 10


class Served(NamedTuple):
    url: str  # the site's root, served on 127.0.0.1
    kb: object
    out: Path  # the folder, for file:// pages


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip(
            "Chromium or chromedriver not installed and not installable here "
            "(`apt-get install chromium chromium-driver`, as .ci/setup does)"
        )
    return browser, driver


@pytest.fixture(scope="module")
def served_site(tmp_path_factory):
    """The site of the real KB plus a hostile team cause, served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("site")
    team = make_hostile_team(root / "team")
    out = root / "public"
    kb = load_kb([REPO_KB, team])
    build_site(kb, out)
    handler = functools.partial(QuietHandler, directory=str(out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Served(f"http://127.0.0.1:{server.server_address[1]}/", kb, out)
    server.shutdown()
    server.server_close()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output to the test's own
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    browser_path, driver_path = chromium_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait_for(driver, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S).until(condition)


def search(driver, text: str):
    """Type into the search box; the result links once some are shown."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "search")
    box.clear()
    box.send_keys(text)
    return wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#results li a"))


def test_index_renders_every_cause(browser, served_site):
    from selenium.webdriver.common.by import By

    url, kb, _ = served_site
    browser.get(url + "index.html")
    assert browser.find_element(By.TAG_NAME, "h1").text == "DDP failure knowledge base"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#cause-list > li")) == len(kb.causes)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#thread-list > li")) == len(kb.threads)


def test_search_then_follow_the_link(browser, served_site):
    from selenium.webdriver.common.by import By

    url, kb, _ = served_site
    browser.get(url + "index.html")
    links = search(browser, "duplicate gpu")
    assert links[0].get_attribute("href") == url + "causes/duplicate-gpu-per-rank.html"
    links[0].click()
    wait_for(browser, lambda d: d.current_url.endswith("/causes/duplicate-gpu-per-rank.html"))
    title = kb.causes["duplicate-gpu-per-rank"].title
    assert browser.find_element(By.TAG_NAME, "h1").text == title
    # The fix is highlighted code, and the community answers are there with their stance.
    assert browser.find_elements(By.CSS_SELECTOR, ".highlight span.n")
    assert browser.find_elements(By.CSS_SELECTOR, ".answer .stance-right")


def test_chinese_search_and_language_switch(browser, served_site):
    from selenium.webdriver.common.by import By

    url, kb, _ = served_site
    browser.get(url + "zh/index.html")
    links = search(browser, "找不到设备")
    assert all("/zh/" in link.get_attribute("href") for link in links)
    browser.get(url + "zh/causes/set-device-order.html")
    assert browser.find_element(By.TAG_NAME, "h1").text == kb.causes["set-device-order"].title_zh
    browser.find_element(By.CSS_SELECTOR, "a.lang").click()
    wait_for(browser, lambda d: d.current_url == url + "causes/set-device-order.html")


def test_search_is_empty_for_nonsense_and_enter_opens_the_first(browser, served_site):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, _, _ = served_site
    browser.get(url + "threads/seed-000-ddp-cant-find-device.html")
    box = browser.find_element(By.ID, "search")
    box.send_keys("zzqxv-no-such-text")
    assert browser.find_element(By.ID, "results").get_attribute("data-count") == "0"
    box.clear()
    first = search(browser, "ncclInvalidUsage")[0].get_attribute("href")
    assert first == url + "causes/duplicate-gpu-per-rank.html"  # a cause before a thread
    browser.find_element(By.ID, "search").send_keys(Keys.ENTER)
    wait_for(browser, lambda d: d.current_url == first)


def test_kb_text_with_script_stays_text(browser, served_site):
    from selenium.webdriver.common.by import By

    url, _, _ = served_site
    for page in (f"causes/{HOSTILE_ID}.html", f"zh/causes/{HOSTILE_ID}.html"):
        browser.get(url + page)
        assert browser.execute_script("return window.kbSitePwned") is None
        assert browser.find_elements(By.TAG_NAME, "h1")
    browser.get(url + f"causes/{HOSTILE_ID}.html")
    assert browser.find_element(By.TAG_NAME, "h1").text == HOSTILE_TITLE
    links = search(browser, "kbSitePwned")  # search results are text too
    assert any(HOSTILE_TITLE == link.text for link in links)
    assert browser.execute_script("return window.kbSitePwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, main iframe, #results script")


def test_search_works_opened_from_disk(browser, served_site):
    """No server at all: the index is a script, so file:// pages search too."""
    out = served_site.out
    browser.get((out / "causes" / "set-device-order.html").as_uri())
    links = search(browser, "duplicate gpu")
    assert links[0].get_attribute("href") == (out / "causes/duplicate-gpu-per-rank.html").as_uri()
