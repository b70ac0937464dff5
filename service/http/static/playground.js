// The playground: a chat with the served model over the server's own OpenAI-compatible API (same origin,
// relative URLs so that it also works behind a path prefix). Replies stream as server-sent events read from
// fetch's ReadableStream; Stop aborts the fetch, which closes the connection, and the server then aborts
// the request and frees its KV cache.
"use strict";

const $ = (id) => document.getElementById(id);
const NUMBER_SETTINGS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed"];
// Conversations are kept in the browser (localStorage): [{id, title, messages}], the shown one is `current`.
const STORE = "ovserve.playground";
let conversations = [];
let current = null;
let history = []; // current.messages: the conversation without the system prompt, {role, content, stats}
let controller = null; // the reply in progress
let running = null; // its promise
let clears = 0; // counts Clears: a reply that ends after one belongs to no conversation
const RETRY_MS = 2000; // while the model loads (503) or the server cannot be reached
const FIELDS = { max_new_tokens: "max_tokens" }; // the server's names for settings whose field is named otherwise

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const token = $("token").value.trim();
  if (token) headers.Authorization = "Bearer " + token;
  return headers;
}

function settings() {
  const body = {};
  for (const name of NUMBER_SETTINGS) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  if ($("ignore_eos").checked) body.ignore_eos = true;
  return body;
}

// A message's box; history[index] is the message. Copy on every message, Edit on the user's, Regenerate on the
// last reply (CSS hides it on the others).
function addMessage(index) {
  const { role, content: text, stats: figures } = history[index];
  const box = document.createElement("div");
  box.className = "message " + role;
  box.dataset.index = index;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  showText(content, role, text);
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = figures || "";
  const actions = document.createElement("div");
  actions.className = "actions";
  for (const action of ["copy", role === "user" ? "edit" : "regenerate"]) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = action;
    button.dataset.action = action;
    button.textContent = action[0].toUpperCase() + action.slice(1);
    actions.append(button);
  }
  box.append(label, content, stats, actions);
  const follow = atBottom();
  $("log").append(box);
  if (follow) toBottom();
  return { box, content, stats };
}

function render() {
  $("log").replaceChildren();
  history.forEach((_, index) => addMessage(index));
  toBottom();
  save();
}

// Stores every conversation that has messages, and the one shown; then lists them.
function save() {
  const first = history.find((message) => message.role === "user");
  current.title = first ? first.content.slice(0, 60) : "New conversation";
  conversations = conversations.filter((c) => c === current || c.messages.length);
  const kept = conversations.map((c) => ({ ...c, messages: c.messages.filter((m) => m.content) }));
  try {
    localStorage.setItem(STORE, JSON.stringify({ current: current.id, conversations: kept }));
  } catch {
    // storage full or turned off: the conversations live as long as the page
  }
  const items = conversations.map((c) => {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = c.title;
    button.title = c.title;
    if (c === current) button.setAttribute("aria-current", "true");
    button.addEventListener("click", () => show(c));
    item.append(button);
    return item;
  });
  $("conversations").replaceChildren(...items);
}

function load() {
  let stored = null;
  try {
    stored = JSON.parse(localStorage.getItem(STORE));
  } catch {
    // nothing stored, or not readable: start afresh
  }
  conversations = stored && Array.isArray(stored.conversations) ? stored.conversations : [];
  show(conversations.find((c) => c.id === (stored && stored.current)) || newConversation());
}

function newConversation() {
  return { id: `${Date.now()}-${Math.random().toString(36).slice(2, 8)}`, title: "", messages: [] };
}

// Shows another conversation; a reply still streaming stops first and is kept where it belongs.
async function show(conversation) {
  if (controller) {
    controller.abort();
    await running;
  }
  if (!conversations.includes(conversation)) conversations.unshift(conversation);
  current = conversation;
  history = conversation.messages;
  clearErrors();
  render();
}

// Replies as markdown, through marked and then DOMPurify, when both loaded (make playground-libs); else as text.
function showText(content, role, text) {
  if (role === "assistant" && window.marked && window.DOMPurify) {
    content.classList.add("markdown");
    content.innerHTML = DOMPurify.sanitize(marked.parse(text));
  } else {
    content.textContent = text;
  }
}

// The view follows a streaming reply only while the user is at the bottom: once they scroll up to read, it stays.
function atBottom() {
  const log = $("log");
  return log.scrollHeight - log.scrollTop - log.clientHeight < 24;
}

function toBottom() {
  $("log").scrollTop = $("log").scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Yields each parsed `data:` payload of an SSE response body.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

function describe(run) {
  const parts = [];
  if (run.first !== null) parts.push(`first token ${Math.round(run.first - run.started)} ms`);
  const tokens = run.usage ? run.usage.completion_tokens : run.chunks;
  const seconds = run.first !== null ? (run.ended - run.first) / 1000 : 0;
  if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
  parts.push(`${tokens} tokens`);
  if (run.usage) {
    const cached = run.usage.prompt_tokens_details ? run.usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(`${cached} of ${run.usage.prompt_tokens} prompt tokens cached`);
  }
  parts.push(run.finish);
  return parts.join(" · ");
}

// An error goes above the conversation, where it is always in view, and next to the setting it names.
function showError(message, param) {
  const field = param ? $("settings").querySelector("#" + CSS.escape(FIELDS[param] || param)) : null;
  $("notice").textContent = field ? `${field.closest("label").firstChild.textContent.trim()}: ${message}` : message;
  $("notice").hidden = false;
  if (!field) return;
  const note = document.createElement("div");
  note.className = "field-error";
  note.textContent = message;
  field.closest("label").append(note);
  field.setAttribute("aria-invalid", "true");
  field.scrollIntoView({ block: "nearest" });
}

// A 401: the server was started with --auth-token-file and the token field is empty or holds another token.
function tokenError() {
  const failure = new Error(
    $("token").value.trim()
      ? "the server refused this token: enter the one in the file given to --auth-token-file"
      : "this server needs a token: enter the one in the file given to --auth-token-file",
  );
  failure.param = "token";
  return failure;
}

function clearErrors() {
  $("notice").hidden = true;
  for (const note of document.querySelectorAll(".field-error")) note.remove();
  for (const field of document.querySelectorAll("[aria-invalid]")) field.removeAttribute("aria-invalid");
}

function send() {
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  history.push({ role: "user", content: text });
  addMessage(history.length - 1);
  save();
  running = reply();
}

// Streams the model's reply to the conversation so far (which ends with the user's message).
async function reply() {
  clearErrors();
  const mine = clears;
  const system = $("system").value.trim();
  const turns = history.map(({ role, content }) => ({ role, content }));
  const messages = (system ? [{ role: "system", content: system }] : []).concat(turns);
  const entry = { role: "assistant", content: "" };
  history.push(entry);
  const view = addMessage(history.length - 1);
  toBottom(); // sending takes the view to the new message
  const run = { started: performance.now(), first: null, ended: null, chunks: 0, usage: null, finish: "" };
  let text = "";
  controller = new AbortController();
  setBusy(true);
  try {
    const body = { messages, stream: true, stream_options: { include_usage: true }, ...settings() };
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: requestHeaders(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response.status === 401) throw tokenError();
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      const failure = new Error(error && error.error ? error.error.message : `HTTP ${response.status}`);
      failure.param = error && error.error && error.error.param;
      throw failure;
    }
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) run.usage = chunk.usage;
      for (const choice of chunk.choices) {
        if (choice.delta.content) {
          if (run.first === null) run.first = performance.now();
          run.chunks += 1;
          text += choice.delta.content;
          const follow = atBottom();
          entry.content = text;
          showText(view.content, "assistant", text);
          if (follow) toBottom();
        }
        if (choice.finish_reason) run.finish = "finished: " + choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      run.finish = "stopped";
    } else {
      run.finish = "error";
      showError(error.message, error.param);
    }
  } finally {
    run.ended = performance.now();
    controller = null;
    setBusy(false);
  }
  if (mine !== clears) return; // cleared while it streamed: not part of the new conversation
  const follow = atBottom();
  view.stats.textContent = describe(run);
  if (follow) toBottom();
  if (text) {
    entry.stats = view.stats.textContent;
    save();
  } else {
    history.length -= 1; // nothing came back: the user's message goes back to the composer, to be sent again
    const { content } = history.pop();
    if (!$("message").value) $("message").value = content;
    render();
  }
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (a page served over plain HTTP to another host) or no permission: the older way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

// Edit: the message becomes a text box; sending it replaces the message and drops everything after it.
function edit(box, index) {
  const area = document.createElement("textarea");
  area.className = "editor";
  area.value = history[index].content;
  area.rows = Math.min(12, area.value.split("\n").length + 1);
  const resend = document.createElement("button");
  resend.type = "button";
  resend.textContent = "Send";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const editor = document.createElement("div");
  editor.append(area, resend, cancel);
  box.querySelector(".content").replaceWith(editor);
  box.querySelector(".actions").hidden = true;
  area.focus();
  cancel.addEventListener("click", render);
  resend.addEventListener("click", () => {
    const text = area.value.trim();
    if (!text || controller) return;
    history.length = index;
    history.push({ role: "user", content: text });
    render();
    running = reply();
  });
}

$("log").addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const box = button.closest(".message");
  const index = Number(box.dataset.index);
  if (button.dataset.action === "copy") {
    copyText(history[index].content).then(() => {
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
  } else if (controller) {
    return; // a reply is streaming: Stop it first
  } else if (button.dataset.action === "regenerate") {
    history.length = index; // the last reply goes; the conversation before it is asked again
    box.remove();
    running = reply();
  } else {
    edit(box, index);
  }
});


let modelRetry = null;

// Shows the served model; while it loads (503) or the server is unreachable, says so and asks again.
async function showModel() {
  clearTimeout(modelRetry);
  let again = false;
  try {
    const response = await fetch("v1/models", { headers: requestHeaders() });
    const body = await response.json();
    if (response.status === 401) {
      $("model").textContent = "token needed";
      clearErrors();
      showError(tokenError().message, "token");
    } else {
      $("model").textContent = response.ok ? body.data[0].id : body.error.message;
    }
    again = response.status === 503;
  } catch (error) {
    $("model").textContent = "server unreachable; retrying";
    again = true;
  }
  if (again) modelRetry = setTimeout(showModel, RETRY_MS);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  clears += 1;
  if (controller) controller.abort(); // the reply in progress stops and stays out of the next conversation
  history.length = 0;
  render();
});
$("new").addEventListener("click", () => history.length && show(newConversation()));
$("token").addEventListener("change", showModel);
$("settings").addEventListener("input", clearErrors);
load();
showModel();
