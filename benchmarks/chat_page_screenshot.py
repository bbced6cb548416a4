"""The README's screenshot of the chat page: real replies of the shipped demo model.

    python benchmarks/chat_page_screenshot.py [--out docs/chat-page.png] [--model DIR]

Starts `dsaserve serve` on a free port, opens the page in headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium as tests/test_chat_page.py does), sends the messages below one
after another in one conversation at temperature 0 with thinking on, and saves the page once the
last answer has finished. The replies are whatever the model writes; the script prints them.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx

MESSAGES = ("Reverse these words: pine river lotus comet",)  # one exchange: the shipped model fails most follow-ups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # the server or the page is not up yet
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def set_field(page, element_id: str, value: str) -> None:
    field = page.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def converse(page, url: str, messages: tuple[str, ...]) -> list[str]:
    page.get(url + "/")
    wait_for(lambda: page.find_element("id", "model").get_attribute("value"), 60, "the model list")
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "120")
    replies = []
    for n, text in enumerate(messages, 1):
        page.find_element("id", "input").send_keys(text)
        page.find_element("id", "send").click()

        def done():
            return (page.find_element("tag name", "body").get_attribute("data-state") == "idle"
                    and len(answers(page)) == n and "finish:" in answers(page)[-1])
        wait_for(done, 120, f"the answer to {text!r}")
        replies.append(answers(page)[-1])
    return replies


def answers(page) -> list[str]:
    return [e.text for e in page.find_elements("css selector", ".msg.assistant")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/chat-page.png")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo)")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "dsaserve", "serve", *([args.model] if args.model else []), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    page = None
    try:
        wait_for(lambda: httpx.get(url + "/v1/models").status_code == 200, 180, "the server")
        page = browser(1100, 620)
        for text, reply in zip(MESSAGES, converse(page, url, MESSAGES)):
            print(f"{text!r} -> {reply!r}")
        page.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        if page is not None:
            page.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
