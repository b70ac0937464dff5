"""The playground page in a real browser: Debian's chromium, driven by selenium through chromedriver, talking
to a real server. Skips where chromium is not installed (`make system-packages` installs it on Debian)."""

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.support.servers import wait_idle

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and DRIVER),
        reason="needs Debian's chromium and chromium-driver (`make system-packages` installs them)",
    ),
]
TIMEOUT = 60

# Records, at every change of the reply's text, its length and whether the Stop button was still enabled
# (the reply still streaming): read back after the reply to see that text arrived in pieces before its end.
WATCH_REPLIES = """
window.seen = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('.message.assistant .content');
  if (replies.length) {
    const last = replies[replies.length - 1];
    window.seen.push([last.textContent.length, !document.getElementById('stop').disabled]);
  }
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_script_timeout(TIMEOUT)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    browser.get(f"http://127.0.0.1:{server.server.http.port}/")
    browser.execute_script("localStorage.clear()")  # no conversations kept from the tests before
    browser.refresh()
    wait_for(lambda: browser.find_element("id", "model").text == server.engine.info.model_id)
    return browser


def wait_for(condition, timeout: float = TIMEOUT):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def fill(page, **settings):
    for name, value in settings.items():
        field = page.find_element("id", name)
        if isinstance(value, bool):
            if field.is_selected() != value:
                field.click()
        else:
            field.clear()
            field.send_keys(str(value))


def send(page, text: str) -> None:
    page.find_element("id", "message").send_keys(text)
    page.find_element("id", "send").click()


def replies(page):
    return page.find_elements("css selector", ".message.assistant")


def test_a_reply_streams_in_with_its_timings(page, server):
    page.execute_script(WATCH_REPLIES)
    fill(page, max_tokens=48, ignore_eos=True, system="Be brief.")
    send(page, "Hello there")
    wait_for(lambda: replies(page) and replies(page)[-1].find_element("class name", "stats").text)
    seen = page.execute_script("return window.seen")
    streaming = {length for length, busy in seen if busy and length}
    assert len(streaming) >= 2, f"text did not arrive in pieces while streaming: {seen}"
    stats = replies(page)[-1].find_element("class name", "stats").text
    assert "first token" in stats and "tokens/s" in stats and "48 tokens" in stats, stats
    assert "prompt tokens cached" in stats and "finished: length" in stats, stats
    send(page, "And again")  # the second turn sends the conversation so far and gets the first from the cache
    wait_for(lambda: len(replies(page)) == 2 and replies(page)[-1].find_element("class name", "stats").text)
    assert "prompt tokens cached" in replies(page)[-1].find_element("class name", "stats").text


def start_a_long_reply(page) -> None:
    """Asks for 3,000 tokens and waits for the first of them."""
    fill(page, max_tokens=3000, ignore_eos=True)
    send(page, "Tell me a very long story")
    wait_for(lambda: replies(page) and len(replies(page)[-1].find_element("class name", "content").text) > 20)


def assert_aborted(server) -> None:
    s = wait_idle(server.engine)
    assert (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)  # aborted on the server


def test_stop_aborts_a_long_reply_on_the_server(page, server):
    start_a_long_reply(page)
    assert server.engine.stats().num_running == 1
    page.find_element("id", "stop").click()
    stats = replies(page)[-1].find_element("class name", "stats")
    wait_for(lambda: "stopped" in stats.text)
    s = wait_idle(server.engine)
    assert (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)
    assert s.num_generated_tokens < 3000  # aborted, not finished
    assert page.find_element("id", "send").is_enabled() and not page.find_element("id", "stop").is_enabled()


def test_clear_during_a_reply_aborts_it_and_keeps_it_out_of_the_next_conversation(page, server):
    start_a_long_reply(page)
    page.find_element("id", "clear").click()
    assert_aborted(server)
    assert page.find_elements("css selector", ".message") == []
    time.sleep(0.5)  # the aborted reply's last steps have run in the page
    assert page.execute_script("return history.length") == 0
    fill(page, max_tokens=4)
    send(page, "Hi")
    wait_for(lambda: replies(page) and replies(page)[-1].find_element("class name", "stats").text)
    assert page.execute_script("return history.map(m => m.role)") == ["user", "assistant"]


def test_a_page_opened_while_the_model_loads_recovers_by_itself(browser, tiny_qwen3_ir):
    from tests.support.servers import Running, base_config, free_port

    running = Running(base_config(tiny_qwen3_ir, http_port=free_port()), load=False)
    try:
        browser.get(f"http://127.0.0.1:{running.server.http.port}/")
        wait_for(lambda: "loading" in browser.find_element("id", "model").text)
        running.call(running.server.load())
        wait_for(lambda: browser.find_element("id", "model").text == running.engine.info.model_id)
    finally:
        running.stop()


def in_view(page, element) -> bool:
    return page.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return r.height > 0 && r.top >= 0 && r.left >= 0 && r.bottom <= innerHeight && r.right <= innerWidth",
        element,
    )


@pytest.fixture
def small_window(page):
    size = page.get_window_size()
    page.set_window_size(560, 480)  # one column: the settings below the conversation, most of them out of view
    yield page
    page.set_window_size(size["width"], size["height"])


def test_an_error_shows_in_view_next_to_the_setting_it_names(small_window, server):
    page = small_window
    fill(page, max_tokens=0)
    send(page, "Hello there")
    wait_for(lambda: page.find_elements("css selector", ".field-error"))
    note = page.find_element("css selector", ".field-error")
    field = page.find_element("id", "max_tokens")
    assert note.find_element("xpath", "..") == field.find_element("xpath", "..")  # in the field's own label
    assert "got 0" in note.text and in_view(page, note) and in_view(page, field)
    notice = page.find_element("id", "notice")
    assert notice.text.startswith("Max tokens: ") and in_view(page, notice)
    # the message that failed is back in the composer and out of the conversation
    assert page.find_element("id", "message").get_attribute("value") == "Hello there"
    assert page.find_elements("css selector", ".message") == [] and page.execute_script("return history.length") == 0
    # an error naming no setting (here an element outside the settings) is shown above the conversation alone
    page.execute_script("clearErrors(); showError('no such model', 'model'); showError('bad', 'messages[0].content')")
    assert notice.text == "bad" and page.find_elements("css selector", ".field-error") == []
    fill(page, max_tokens=3)  # editing a setting takes the errors away; the message goes through
    assert page.find_elements("css selector", ".field-error") == [] and not notice.is_displayed()
    page.find_element("id", "send").click()
    wait_for(lambda: replies(page) and replies(page)[-1].find_element("class name", "stats").text)
    assert page.execute_script("return history.map(m => m.role)") == ["user", "assistant"]


@pytest.fixture(scope="module")
def locked_server(tiny_qwen3_ir, tmp_path_factory):
    from tests.support.servers import Running, base_config, free_port

    token = tmp_path_factory.mktemp("locked") / "token"
    token.write_text(TOKEN + "\n")
    running = Running(base_config(tiny_qwen3_ir, http_port=free_port(), auth_token_file=str(token)))
    yield running
    running.stop()


TOKEN = "s3cret"


def enter_token(page, token: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = page.find_element("id", "token")
    field.clear()
    field.send_keys(token, Keys.TAB)  # leaving the field sends it: the page asks for the model with it


def test_a_server_with_a_token_asks_for_it_and_says_in_view_when_it_is_missing_or_wrong(browser, locked_server):
    page = browser
    page.get(f"http://127.0.0.1:{locked_server.server.http.port}/")
    page.execute_script("localStorage.clear()")
    size = page.get_window_size()
    page.set_window_size(560, 480)  # one column: the token field is far below the conversation
    try:
        page.refresh()
        notice, model = page.find_element("id", "notice"), page.find_element("id", "model")
        wait_for(lambda: model.text == "token needed")  # the page asks for it as it opens
        assert notice.text.startswith("API token: this server needs a token") and in_view(page, notice)
        token_label = page.find_element("id", "token").find_element("xpath", "..")
        assert token_label.find_element("class name", "field-error").text.startswith("this server needs a token")
        for token, says in (("", "this server needs a token"), ("wrong", "the server refused this token")):
            if token:
                enter_token(page, token)
                wait_for(lambda: says in notice.text)  # noqa: B023 (called before the loop moves on)
            send(page, "Hello there")
            # the send failed: the message back in the composer, nothing in the conversation, the reason in view
            wait_for(lambda: page.find_element("id", "message").get_attribute("value") == "Hello there")
            assert (
                page.find_elements("css selector", ".message") == []
                and page.execute_script("return history.length") == 0
            )
            assert notice.text == f"API token: {says}: enter the one in the file given to --auth-token-file"
            assert in_view(page, notice) and page.find_element("id", "send").is_enabled()
            page.find_element("id", "message").clear()
        enter_token(page, TOKEN)
        wait_for(lambda: model.text == locked_server.engine.info.model_id)
        assert not notice.is_displayed() and page.find_elements("css selector", ".field-error") == []
        fill(page, max_tokens=4)
        send(page, "Hello there")
        wait_for(lambda: answered(page, 1))
        assert "finished" in replies(page)[0].find_element("class name", "stats").text
    finally:
        page.set_window_size(size["width"], size["height"])


LOG_SCROLL = "const log = document.getElementById('log'); return [log.scrollTop, log.scrollHeight - log.clientHeight]"


def test_a_streaming_reply_is_followed_only_while_the_reader_is_at_the_bottom(page, server):
    fill(page, max_tokens=3000, ignore_eos=True)
    send(page, "Tell me a very long story")
    scroll = lambda: page.execute_script(LOG_SCROLL)  # noqa: E731
    wait_for(lambda: scroll()[1] > 150)  # the reply overflows the view
    top, bottom = scroll()
    assert bottom - top < 24, (top, bottom)  # and the view went with it
    page.execute_script("document.getElementById('log').scrollTop = 40")  # the reader scrolls up
    grown = scroll()[1] + 120
    wait_for(lambda: scroll()[1] > grown)
    assert scroll()[0] == 40  # the view stays where the reader is
    page.execute_script("const log = document.getElementById('log'); log.scrollTop = log.scrollHeight")
    grown = scroll()[1] + 120
    wait_for(lambda: scroll()[1] > grown)  # back at the bottom, the view follows again
    top, bottom = scroll()
    assert bottom - top < 24, (top, bottom)
    assert server.engine.stats().num_running == 1  # all of it while the reply streamed
    page.find_element("id", "stop").click()
    wait_idle(server.engine)


# Records the body of every request the page sends.
WATCH_REQUESTS = """
window.sent = [];
const fetched = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) window.sent.push(JSON.parse(options.body));
  return fetched(url, options);
};
"""


def answered(page, count: int) -> bool:
    return len(replies(page)) == count and bool(replies(page)[-1].find_element("class name", "stats").text)


def talk(page, *messages: str) -> None:
    for text in messages:
        count = len(replies(page)) + 1
        send(page, text)
        wait_for(lambda: answered(page, count))  # noqa: B023 (called before the loop moves on)


def roles_and_texts(page):
    return page.execute_script("return history.map(m => [m.role, m.content])")


def test_copy_puts_a_message_on_the_clipboard_with_or_without_the_clipboard_api(page, server):
    fill(page, max_tokens=6, ignore_eos=True)
    talk(page, "Copy me")
    page.execute_script("navigator.clipboard.writeText = (text) => { window.copied = text; return Promise.resolve(); }")
    page.find_element("css selector", ".message.user button.copy").click()
    wait_for(lambda: page.execute_script("return window.copied") == "Copy me")
    # without the API (or refused by it), a selected text box and execCommand("copy")
    page.execute_script("""
        navigator.clipboard.writeText = () => Promise.reject(new DOMException("denied", "NotAllowedError"));
        const command = document.execCommand.bind(document);
        document.execCommand = (name) => {
          window.copied = [name, document.activeElement.value];
          return command(name);
        };
    """)
    button = replies(page)[-1].find_element("css selector", "button.copy")
    button.click()
    reply = roles_and_texts(page)[-1][1]
    assert reply
    wait_for(lambda: page.execute_script("return window.copied") == ["copy", reply])
    wait_for(lambda: button.text == "Copied")


def test_regenerate_asks_again_without_the_last_reply(page, server):
    fill(page, max_tokens=6, ignore_eos=True)
    talk(page, "First", "Second")
    regenerate = [r.find_element("css selector", "button.regenerate").is_displayed() for r in replies(page)]
    assert regenerate == [False, True]  # only on the last reply
    before = roles_and_texts(page)
    page.execute_script(WATCH_REQUESTS)
    replies(page)[-1].find_element("css selector", "button.regenerate").click()
    wait_for(
        lambda: page.execute_script("return window.sent.length") == 1 and not page.execute_script("return controller")
    )
    sent = page.execute_script("return window.sent[0].messages")
    assert sent == [{"role": r, "content": c} for r, c in before[:3]]  # the conversation up to the last question
    after = roles_and_texts(page)
    assert [r for r, _ in after] == ["user", "assistant", "user", "assistant"] and after[:3] == before[:3]
    assert len(replies(page)) == 2 and "6 tokens" in replies(page)[-1].find_element("class name", "stats").text


def test_edit_and_resend_replaces_a_message_and_drops_what_came_after(page, server):
    fill(page, max_tokens=6, ignore_eos=True)
    talk(page, "First", "Second")
    page.execute_script(WATCH_REQUESTS)
    first = page.find_elements("css selector", ".message.user")[0]
    first.find_element("css selector", "button.edit").click()
    editor = first.find_element("css selector", "textarea.editor")
    assert editor.get_attribute("value") == "First"
    editor.clear()
    editor.send_keys("Changed")
    first.find_element("xpath", ".//button[text()='Send']").click()
    wait_for(lambda: len(replies(page)) == 1 and replies(page)[0].find_element("class name", "stats").text)
    assert page.execute_script("return window.sent.map(body => body.messages)") == [
        [{"role": "user", "content": "Changed"}]
    ]
    assert [r for r, _ in roles_and_texts(page)] == ["user", "assistant"] and roles_and_texts(page)[0][1] == "Changed"
    assert [m.text for m in page.find_elements("css selector", ".message.user .content")] == ["Changed"]


def conversation_titles(page):
    return [item.text for item in page.find_elements("css selector", "#conversations button")]


def test_conversations_are_kept_in_the_browser_and_switched_between(page, server):
    fill(page, max_tokens=6, ignore_eos=True)
    talk(page, "Alpha one", "Alpha two")
    alpha = roles_and_texts(page)
    page.find_element("id", "new").click()
    wait_for(lambda: conversation_titles(page) == ["New conversation", "Alpha one"])
    assert page.find_elements("css selector", ".message") == []
    talk(page, "Beta")
    assert conversation_titles(page) == ["Beta", "Alpha one"]
    beta = roles_and_texts(page)
    page.refresh()
    wait_for(lambda: page.find_element("id", "model").text == server.engine.info.model_id)
    assert conversation_titles(page) == ["Beta", "Alpha one"] and roles_and_texts(page) == beta  # the one shown
    assert "6 tokens" in replies(page)[0].find_element("class name", "stats").text  # with its figures
    page.find_elements("css selector", "#conversations button")[1].click()
    wait_for(lambda: roles_and_texts(page) == alpha)
    shown = [m.text for m in page.find_elements("css selector", ".message .content")]
    assert shown[0] == "Alpha one" and shown[2] == "Alpha two" and len(shown) == 4
    current = page.find_element("css selector", "#conversations button[aria-current]")
    assert current.text == "Alpha one"
    fill(page, max_tokens=6, ignore_eos=True)  # settings are not kept
    talk(page, "Alpha three")  # the conversation goes on with its history
    sent = page.execute_script("return history.slice(0, 4).map(m => m.content)")
    assert sent == [text for _, text in alpha]


def test_switching_conversations_stops_a_reply_and_keeps_it_where_it_belongs(page, server):
    start_a_long_reply(page)
    page.find_element("id", "new").click()
    assert_aborted(server)
    wait_for(lambda: conversation_titles(page) == ["New conversation", "Tell me a very long story"])
    page.find_elements("css selector", "#conversations button")[1].click()
    wait_for(lambda: len(replies(page)) == 1)
    assert "stopped" in replies(page)[0].find_element("class name", "stats").text
    assert [r for r, _ in roles_and_texts(page)] == ["user", "assistant"]


VENDOR = Path(__file__).parent.parent / "service/http/static/vendor"
MARKDOWN = (
    "Some **bold** text.\n\n```python\nprint('hi')\n```\n\n"
    '<img src=x onerror="window.pwned = 1"><script>window.pwned = 2</script>'
)


def show_a_stored_reply(page, server, content: str) -> None:
    stored = {"role": "assistant", "content": content, "stats": "6 tokens"}
    conversation = {"id": "1", "title": "Markdown", "messages": [{"role": "user", "content": "Show **me**"}, stored]}
    page.execute_script(
        "localStorage.setItem('ovserve.playground', arguments[0])",
        json.dumps({"current": "1", "conversations": [conversation]}),
    )
    page.refresh()
    wait_for(lambda: page.find_element("id", "model").text == server.engine.info.model_id)


@pytest.mark.skipif(not (VENDOR / "marked.umd.js").exists(), reason="needs `make playground-libs` (npm)")
def test_replies_render_as_sanitized_markdown(page, server):
    show_a_stored_reply(page, server, MARKDOWN)
    reply = replies(page)[0].find_element("class name", "content")
    assert reply.find_element("tag name", "strong").text == "bold"
    assert reply.find_element("css selector", "pre code.language-python").text == "print('hi')"
    assert reply.find_element("tag name", "img").get_attribute("onerror") is None  # sanitized
    assert reply.find_elements("tag name", "script") == []
    assert page.execute_script("return window.pwned") is None
    user = page.find_element("css selector", ".message.user .content")
    assert user.text == "Show **me**"  # what the user typed stays as typed
    fill(page, max_tokens=6, ignore_eos=True)
    talk(page, "Go on")  # a streamed reply goes through the renderer too
    assert "markdown" in replies(page)[-1].find_element("class name", "content").get_attribute("class")


def test_without_the_markdown_libraries_replies_show_as_plain_text(page, server):
    show_a_stored_reply(page, server, MARKDOWN)
    page.execute_script("delete window.marked; delete window.DOMPurify; render()")
    reply = replies(page)[0].find_element("class name", "content")
    assert reply.text.startswith("Some **bold** text.") and reply.find_elements("css selector", "*") == []
