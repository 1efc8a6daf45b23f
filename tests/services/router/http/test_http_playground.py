"""The playground page in a real headless Chromium (Debian chromium + chromium-driver, driven by Selenium):
it streams a chat completion from the router, shows the draft's accepted tokens and the target's own in
two colours, renders the figures, and its text is the gRPC SDK's greedy output for the same prompt; with a
JSON schema, the answer is JSON valid against it and the tokens the schema forced show in their colour.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from specserve.client import Client

pytestmark = [pytest.mark.distributed, pytest.mark.model]

CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's; Selenium Manager cannot download one offline
PROMPT = "Write a haiku about rain."
METHOD = "glide"
MAX_TOKENS = 24
TIMEOUT_SECONDS = 120


@pytest.fixture(scope="module")
def browser():
    if shutil.which("chromium") is None or shutil.which(CHROMEDRIVER) is None:
        pytest.fail("needs Debian chromium and chromium-driver (scripts/setup.sh installs them)")
    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _send(browser, wait, prompt_text: str, max_tokens: int) -> str:
    """Types the prompt and the limits (greedy), sends, and waits for the page's final status."""
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(prompt_text)
    for field, value in (("max-tokens", max_tokens), ("temperature", 0)):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(str(value))
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_element(By.ID, "status").text.startswith(("done", "error")))
    return str(browser.find_element(By.ID, "status").text)


def test_the_page_streams_rounds_in_two_colours_with_figures(browser, http_router, tmp_path) -> None:
    with Client(http_router.grpc_address, token=http_router.token) as sdk:
        reference = sdk.generate(
            PROMPT, method=METHOD, max_new_tokens=MAX_TOKENS, temperature=0.0, timeout=TIMEOUT_SECONDS
        )
    browser.get(http_router.page_url)
    wait = WebDriverWait(browser, TIMEOUT_SECONDS)
    browser.find_element(By.ID, "api-key").send_keys(http_router.token)
    browser.find_element(By.ID, "prompt").click()  # leaving the key's field loads the methods with it
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
    Select(browser.find_element(By.ID, "method")).select_by_value(METHOD)
    status = _send(browser, wait, PROMPT, MAX_TOKENS)
    assert status.startswith("done: length"), status

    assert browser.execute_script("return document.getElementById('output').textContent") == reference.text
    accepted = browser.find_elements(By.CSS_SELECTOR, "#output .accepted")
    target = browser.find_elements(By.CSS_SELECTOR, "#output .target")
    assert accepted and target, "both the draft's accepted tokens and the target's own must be shown"
    assert accepted[0].value_of_css_property("color") != target[0].value_of_css_property("color")
    rounds = browser.find_elements(By.CSS_SELECTOR, "#output .round")

    def figure(name: str) -> float:
        return float(browser.find_element(By.ID, name).text.rstrip("%"))

    assert figure("tokens") == MAX_TOKENS
    assert figure("rounds") == len(rounds) == len(browser.find_elements(By.CSS_SELECTOR, "#chart div"))
    assert figure("tokens-per-second") > 0
    assert figure("mean-accepted") == pytest.approx(MAX_TOKENS / len(rounds), abs=0.01)
    assert 0 < figure("accepted-share") < 100

    png = browser.get_screenshot_as_png()
    (tmp_path / "playground.png").write_bytes(png)  # kept with pytest's temporary files, for a look
    screenshot = Image.open(io.BytesIO(png)).convert("RGB")
    colours = screenshot.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is blank or nearly so"
    most_common = max(count for count, _ in colours)
    assert most_common < 0.9 * screenshot.width * screenshot.height


SCHEMA = (
    '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, '
    '"country": {"type": "string", "maxLength": 16}}, "required": ["city", "country"], '
    '"additionalProperties": false}'
)


def test_a_json_schema_holds_the_answer_and_its_forced_tokens_show(browser, http_router) -> None:
    browser.get(http_router.page_url)
    wait = WebDriverWait(browser, TIMEOUT_SECONDS)
    browser.find_element(By.ID, "api-key").send_keys(http_router.token)
    browser.find_element(By.ID, "schema").send_keys(SCHEMA)
    status = _send(browser, wait, "Name the largest city of France and its country, as JSON.", 48)
    assert status.startswith("done: stop"), status
    text = browser.execute_script("return document.getElementById('output').textContent")
    answer = json.loads(text)
    assert set(answer) == {"city", "country"}
    forced = browser.find_elements(By.CSS_SELECTOR, "#output .forced")
    assert forced, "the schema's fixed parts are forced tokens, shown apart"
    # Forced: the schema's fixed parts (which of them depends on what the draft proposed itself).
    skeleton = '{"city": "", "country": ""}'
    assert all(f.text.strip() in skeleton for f in forced), [f.text for f in forced]
