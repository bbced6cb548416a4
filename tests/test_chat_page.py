"""The chat page at / in a real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium): load it, send a message and see the streamed answer, stop a long answer and see the server's
running requests go back to 0, and give an API key when the server asks for one."""

import shutil
import time

import httpx
import pytest
from server_process import ServerProcess

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("the page did not get there in time")


def send(browser, text: str, max_tokens: int) -> None:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, "max_tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def answers(browser) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")]


def idle(browser) -> bool:
    return browser.find_element("tag name", "body").get_attribute("data-state") == "idle"


def running(server) -> float:
    return server.metrics()["dsaserve:num_requests_running"]


def test_a_message_streams_an_answer_and_stop_aborts_a_long_one(browser, server, tmp_path):
    browser.get(server.url + "/")
    wait_for(lambda: browser.find_element("id", "model").get_attribute("value") == "tiny")
    send(browser, "Hello there", max_tokens=24)
    wait_for(lambda: idle(browser) and answers(browser) and "finish:" in answers(browser)[-1])
    assert answers(browser)[-1].split("finish:")[0].strip()  # streamed text arrived
    browser.save_screenshot(str(tmp_path / "chat.png"))

    # The random tiny model may end an answer early on its own: try until one is stopped mid-stream.
    for attempt in range(5):
        browser.find_element("id", "clear").click()  # a fresh conversation, so 400 tokens fit the context
        send(browser, "Now say a lot", max_tokens=400)
        wait_for(lambda: answers(browser) and (answers(browser)[-1].strip() or idle(browser)))
        browser.find_element("id", "stop").click()
        wait_for(lambda: idle(browser))
        if "stopped" in answers(browser)[-1]:
            break
    assert "stopped" in answers(browser)[-1]
    wait_for(lambda: running(server) == 0, timeout=30)
    assert server.metrics()["dsaserve:kv_cache_usage_perc"] == 0


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--api-key", "page-key").wait_ready()
    yield srv
    srv.stop()


def test_the_page_asks_for_the_key_when_the_server_wants_one(browser, keyed):
    browser.get(keyed.url + "/")
    keybar = browser.find_element("id", "keybar")
    wait_for(keybar.is_displayed)
    browser.find_element("id", "key").send_keys("page-key")
    browser.find_element("id", "savekey").click()
    wait_for(lambda: browser.find_element("id", "model").get_attribute("value") == "tiny")
    send(browser, "Hi", max_tokens=8)
    wait_for(lambda: idle(browser) and answers(browser) and "finish:" in answers(browser)[-1])
    assert httpx.get(keyed.url + "/v1/models", timeout=10).status_code == 401  # the key is really needed
