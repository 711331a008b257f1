// The chat page: conversations in localStorage, replies streamed from this server's
// /v1/chat/completions (SSE), the API key (when the server wants one) in sessionStorage.
"use strict";

(() => {
  const STORE = "lmserve.chats";
  const CURRENT = "lmserve.current";
  const SETTINGS = "lmserve.settings";
  const KEY = "lmserve.apiKey";
  const FIELDS = { system: "system", temperature: "temperature", top_p: "top-p",
    max_tokens: "max-tokens", schema: "schema", tools: "tools" };

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  };

  const state = {
    chats: [],
    current: null, // id of the conversation shown; null: a new one, created on send
    meta: null, // the served model, from /v1/models
    running: null, // {chat, msg, controller} of the reply being streamed
    settings: {},
  };

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ---------------------------------------------------------------- storage

  function readJson(storage, key, fallback) {
    try {
      const value = JSON.parse(storage.getItem(key));
      return value === null ? fallback : value;
    } catch {
      return fallback;
    }
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state.chats));
      localStorage.setItem(CURRENT, JSON.stringify(state.current));
    } catch (err) {
      notice(`Could not save the conversations: ${err.message}`);
    }
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify(state.settings));
  }

  const chatById = (id) => state.chats.find((c) => c.id === id) || null;
  const currentChat = () => chatById(state.current);

  // ---------------------------------------------------------------- API

  async function errorMessage(resp) {
    const text = await resp.text().catch(() => "");
    try {
      const body = JSON.parse(text);
      const err = body.error || body;
      if (err && typeof err.message === "string") return err.message;
      if (typeof body.detail === "string") return body.detail;
    } catch {
      // not JSON: the text itself
    }
    return text.trim() || `${resp.status} ${resp.statusText}`;
  }

  let keyPrompt = null; // one dialog for every request that met a 401

  function askKey(message) {
    if (keyPrompt) return keyPrompt;
    keyPrompt = new Promise((resolve) => {
      const dialog = $("key-dialog");
      const input = $("key-input");
      $("key-message").textContent = message;
      input.value = "";
      const done = (value) => {
        $("key-save").onclick = $("key-cancel").onclick = input.onkeydown = dialog.oncancel = null;
        dialog.close();
        keyPrompt = null;
        resolve(value);
      };
      $("key-save").onclick = () => done(input.value.trim() || null);
      $("key-cancel").onclick = () => done(null);
      dialog.oncancel = (ev) => { ev.preventDefault(); done(null); };
      input.onkeydown = (ev) => {
        if (ev.key === "Enter") { ev.preventDefault(); done(input.value.trim() || null); }
      };
      dialog.showModal();
      input.focus();
    });
    return keyPrompt;
  }

  // fetch() with the API key; a 401 asks for the key and tries again
  async function api(path, init = {}) {
    for (;;) {
      const headers = { ...(init.headers || {}) };
      const key = sessionStorage.getItem(KEY);
      if (key) headers.Authorization = `Bearer ${key}`;
      const resp = await fetch(path, { ...init, headers });
      if (resp.status !== 401) return resp;
      const message = await errorMessage(resp);
      const entered = await askKey(key ? `The key was refused: ${message}` : message);
      if (!entered) throw new ApiError(401, message);
      sessionStorage.setItem(KEY, entered);
      $("forget-key").hidden = false;
      if (init.signal && init.signal.aborted) throw new DOMException("aborted", "AbortError");
    }
  }

  // the data fields of a text/event-stream, one string per event
  async function* events(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  async function loadModel() {
    try {
      const resp = await api("v1/models");
      if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
      const model = (await resp.json()).data[0];
      state.meta = { id: model.id, ...(model.meta || {}) };
      notice(null);
    } catch (err) {
      state.meta = null;
      notice(`Cannot read the served model: ${err.message}`);
    }
    showModel();
  }

  function showModel() {
    const meta = state.meta;
    $("model-id").textContent = meta ? meta.id : "no model";
    const parts = [];
    if (meta && meta.family) parts.push(meta.family);
    if (meta && meta.n_ctx) parts.push(`context ${meta.n_ctx.toLocaleString("en")}`);
    $("model-meta").textContent = parts.join(" · ");
    const reasoning = !!(meta && meta.capabilities && meta.capabilities.reasoning);
    $("thinking-switch").hidden = !reasoning;
  }

  // ---------------------------------------------------------------- requests

  function number(value) {
    if (value === undefined || value === null || String(value).trim() === "") return undefined;
    const n = Number(value);
    return Number.isFinite(n) ? n : undefined;
  }

  function parseJsonSetting(name, text) {
    try {
      return JSON.parse(text);
    } catch (err) {
      throw new Error(`The ${name} setting is not valid JSON: ${err.message}`);
    }
  }

  function tools(text) {
    let list = parseJsonSetting("tools", text);
    if (!Array.isArray(list)) list = [list];
    return list.map((t) => (t && t.type === "function" && t.function ? t : { type: "function", function: t }));
  }

  function responseFormat(text) {
    const schema = parseJsonSetting("JSON schema", text);
    const named = schema && typeof schema === "object" && schema.schema && schema.name;
    return {
      type: "json_schema",
      json_schema: named ? schema : { name: "reply", schema, strict: true },
    };
  }

  // the conversation as the API wants it: failed or empty replies left out
  function history(chat) {
    const s = state.settings;
    const out = [];
    if ((s.system || "").trim()) out.push({ role: "system", content: s.system });
    for (const m of chat.messages) {
      if (m.role === "assistant") {
        const calls = m.tool_calls || [];
        if (!m.content && !calls.length) continue;
        const turn = { role: "assistant", content: m.content || (calls.length ? null : "") };
        if (calls.length) turn.tool_calls = calls;
        if (m.reasoning_content) turn.reasoning_content = m.reasoning_content;
        out.push(turn);
      } else if (m.role === "tool") {
        out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
      } else {
        out.push({ role: m.role, content: m.content });
      }
    }
    return out;
  }

  function requestBody(chat) {
    const s = state.settings;
    const body = {
      model: state.meta ? state.meta.id : "default",
      messages: history(chat),
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = number(s.temperature);
    const topP = number(s.top_p);
    const maxTokens = number(s.max_tokens);
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = Math.round(maxTokens);
    if ((s.schema || "").trim()) body.response_format = responseFormat(s.schema);
    if ((s.tools || "").trim()) body.tools = tools(s.tools);
    const caps = state.meta && state.meta.capabilities;
    if (caps && caps.reasoning) body.reasoning_effort = s.thinking ? "high" : "none";
    return body;
  }

  function merge(calls, deltas) {
    for (const d of deltas) {
      const index = d.index ?? calls.length;
      let call = calls[index];
      if (!call) {
        call = calls[index] = { id: d.id || `call_${index}`, type: "function",
          function: { name: "", arguments: "" } };
      }
      if (d.id) call.id = d.id;
      if (d.function) {
        if (d.function.name) call.function.name += d.function.name;
        if (d.function.arguments) call.function.arguments += d.function.arguments;
      }
    }
  }

  async function complete(chat) {
    const msg = { role: "assistant", content: "", reasoning_content: "", tool_calls: [], stats: {} };
    let body;
    try {
      body = requestBody(chat);
    } catch (err) {
      msg.error = err.message;
      chat.messages.push(msg);
      save();
      render();
      return;
    }
    chat.messages.push(msg);
    const controller = new AbortController();
    state.running = { chat, msg, controller };
    save();
    render();
    setBusy(true);
    const stats = msg.stats;
    const started = performance.now();
    let first = null;
    let last = null;
    let pieces = 0;
    const tick = () => {
      const now = performance.now();
      if (first === null) first = now;
      last = now;
      pieces++;
      stats.ttft_ms = Math.round(first - started);
      if (pieces > 1) stats.tps = (pieces - 1) / ((last - first) / 1000);
    };
    try {
      const resp = await api("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
      for await (const data of events(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(null, chunk.error.message || JSON.stringify(chunk.error));
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if (d.reasoning_content) { msg.reasoning_content += d.reasoning_content; tick(); }
          if (d.content) { msg.content += d.content; tick(); }
          if (d.tool_calls) { merge(msg.tool_calls, d.tool_calls); tick(); }
          if (choice.finish_reason) stats.finish = choice.finish_reason;
        }
        if (chunk.usage) {
          const u = chunk.usage;
          stats.tokens = u.completion_tokens;
          stats.prompt = u.prompt_tokens;
          stats.cached = (u.prompt_tokens_details || {}).cached_tokens || 0;
          // the server's count replaces the count of streamed pieces
          if (first !== null && last > first && u.completion_tokens > 1) {
            stats.tps = (u.completion_tokens - 1) / ((last - first) / 1000);
          }
        }
        schedule(chat, msg);
      }
    } catch (err) {
      if (err.name === "AbortError") stats.finish = "stopped";
      else msg.error = err.status ? `${err.message} (HTTP ${err.status})` : err.message;
    } finally {
      if (stats.tokens === undefined && pieces) stats.tokens = pieces;
      state.running = null;
      setBusy(false);
      save();
      render();
    }
  }

  // one repaint per frame while a reply streams
  let pending = null;
  function schedule(chat, msg) {
    if (pending) return;
    pending = requestAnimationFrame(() => {
      pending = null;
      if (chat.id !== state.current) return;
      const node = document.querySelector(`.msg[data-index="${chat.messages.indexOf(msg)}"]`);
      if (node) fill(node, msg, chat);
      showSpeed(msg.stats, true);
      stickToBottom();
    });
  }

  function newChat(title) {
    const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 7),
      title: title.slice(0, 60), created: Date.now(), messages: [] };
    state.chats.unshift(chat);
    state.current = chat.id;
    return chat;
  }

  async function send() {
    const input = $("input");
    const text = input.value;
    if (!text.trim() || state.running) return;
    const chat = currentChat() || newChat(text.trim().split("\n")[0]);
    chat.messages.push({ role: "user", content: text });
    chat.updated = Date.now();
    input.value = "";
    await complete(chat);
  }

  function answerCall(chat, call, text) {
    if (state.running) return;
    chat.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content: text });
    chat.updated = Date.now();
    const turn = lastCallTurn(chat);
    const open = turn ? openCalls(chat, turn) : [];
    save();
    if (open.length) render();
    else complete(chat); // every call has its result: the model goes on
  }

  // the last assistant turn, if the conversation ends with its calls and their results
  function lastCallTurn(chat) {
    for (let i = chat.messages.length - 1; i >= 0; i--) {
      const m = chat.messages[i];
      if (m.role === "tool") continue;
      return m.role === "assistant" && (m.tool_calls || []).length ? m : null;
    }
    return null;
  }

  // the result given to a call of ``turn``: a tool message right after that turn
  function resultOf(chat, turn, id) {
    for (let i = chat.messages.indexOf(turn) + 1; i < chat.messages.length; i++) {
      const m = chat.messages[i];
      if (m.role !== "tool") break;
      if (m.tool_call_id === id) return m;
    }
    return null;
  }
  const openCalls = (chat, turn) => turn.tool_calls.filter((c) => !resultOf(chat, turn, c.id));

  // ---------------------------------------------------------------- view

  function notice(text) {
    const node = $("notice");
    node.hidden = !text;
    node.textContent = text || "";
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("input").placeholder = busy ? "The model is replying…" : "Message (Enter to send, Shift+Enter for a new line)";
  }

  function showSpeed(stats, live) {
    const node = $("speed");
    if (!stats || stats.tps === undefined) {
      node.textContent = live ? "…" : "";
      return;
    }
    node.textContent = `${stats.tps.toFixed(1)} tok/s`;
  }

  function stickToBottom(force) {
    const box = $("messages");
    if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  }

  function renderList() {
    const list = $("chats");
    list.replaceChildren();
    for (const chat of state.chats) {
      const item = el("li", chat.id === state.current ? "active" : "");
      item.dataset.id = chat.id;
      const open = el("button", "open", chat.title || "(untitled)");
      open.type = "button";
      open.title = chat.title;
      open.onclick = () => select(chat.id);
      const del = el("button", "delete", "×");
      del.type = "button";
      del.title = "Delete this conversation";
      del.setAttribute("aria-label", `Delete ${chat.title}`);
      del.onclick = () => remove(chat.id);
      item.append(open, del);
      list.append(item);
    }
  }

  function statsText(msg) {
    const s = msg.stats || {};
    const parts = [];
    if (s.tokens !== undefined) parts.push(`${s.tokens} token${s.tokens === 1 ? "" : "s"}`);
    if (s.tps !== undefined) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (s.prompt !== undefined) {
      parts.push(`prompt ${s.prompt}${s.cached ? ` (${s.cached} cached)` : ""}`);
      if (state.meta && state.meta.n_ctx && s.tokens !== undefined) {
        parts.push(`context ${s.prompt + s.tokens} / ${state.meta.n_ctx}`);
      }
    }
    if (s.finish === "stopped") parts.push("stopped");
    else if (s.finish && s.finish !== "stop") parts.push(`finish: ${s.finish}`);
    return parts.join(" · ");
  }

  function toolCall(chat, turn, call, canAnswer) {
    const box = el("div", "tool-call");
    box.dataset.callId = call.id;
    box.append(el("div", "call-name", `${call.function.name}()`));
    let args = call.function.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* as written */ }
    box.append(el("pre", "call-args", args));
    const result = resultOf(chat, turn, call.id);
    if (result) {
      box.append(el("div", "answered", `result sent (${call.id})`));
    } else if (canAnswer) {
      const answer = el("div", "answer");
      const text = el("textarea");
      text.rows = 2;
      text.placeholder = `Paste the result of ${call.function.name} here`;
      const button = el("button", "send-result", "Send result");
      button.type = "button";
      button.onclick = () => { if (text.value.trim()) answerCall(chat, call, text.value); };
      answer.append(text, button);
      box.append(answer);
    }
    return box;
  }

  // fill a message's node from the message (called again as a reply streams)
  function fill(node, msg, chat) {
    const live = state.running && state.running.msg === msg;
    node.classList.toggle("live", !!live);
    if (msg.role === "user") {
      node.querySelector(".body").textContent = msg.content;
      return;
    }
    if (msg.role === "tool") {
      node.querySelector("pre").textContent = msg.content;
      return;
    }
    const details = node.querySelector(".reasoning");
    details.hidden = !msg.reasoning_content;
    if (msg.reasoning_content) {
      const thinking = live && !msg.content && !(msg.tool_calls || []).length;
      details.querySelector("summary").textContent = thinking ? "Thinking…" : "Reasoning";
      details.querySelector(".reasoning-body").textContent = msg.reasoning_content.trim();
      if (!node.dataset.toggled) details.open = thinking; // open while it thinks, then folded
    }
    const content = node.querySelector(".content");
    content.innerHTML = LmMarkdown.render(msg.content || "");
    const calls = node.querySelector(".tool-calls");
    calls.replaceChildren();
    const turn = lastCallTurn(chat);
    for (const call of msg.tool_calls || []) calls.append(toolCall(chat, msg, call, !live && turn === msg));
    const error = node.querySelector(".error");
    error.hidden = !msg.error;
    error.textContent = msg.error || "";
    node.querySelector(".stats").textContent = live ? statsText(msg) || "…" : statsText(msg);
  }

  function messageNode(msg, index, chat) {
    const node = el("div", `msg ${msg.role}`);
    node.dataset.index = index;
    if (msg.role === "user") {
      node.append(el("div", "role", "You"), el("div", "body"));
    } else if (msg.role === "tool") {
      const call = (msg.name ? `${msg.name}() ` : "") + `result (${msg.tool_call_id})`;
      const box = el("div", "tool-result");
      box.append(el("div", "call-name", call), el("pre"));
      node.append(el("div", "role", "Tool"), box);
    } else {
      const details = el("details", "reasoning");
      const summary = el("summary", null, "Reasoning");
      details.append(summary, el("div", "reasoning-body"));
      // once the user opens or folds the block, the page leaves it as they set it
      summary.addEventListener("click", () => { node.dataset.toggled = "1"; });
      const name = (state.meta && state.meta.id) || "Assistant";
      node.append(el("div", "role", name), details, el("div", "content"),
        el("div", "tool-calls"), el("div", "error"), el("div", "stats"));
    }
    fill(node, msg, chat);
    return node;
  }

  function render() {
    renderList();
    const box = $("messages");
    const chat = currentChat();
    box.replaceChildren();
    if (!chat || !chat.messages.length) {
      box.append(el("div", "empty", "Send a message to start a conversation."));
    } else {
      chat.messages.forEach((msg, i) => box.append(messageNode(msg, i, chat)));
      const last = [...chat.messages].reverse().find((m) => m.role === "assistant");
      showSpeed(last && last.stats, false);
    }
    stickToBottom(true);
  }

  function select(id) {
    state.current = id;
    save();
    showSidebar(false);
    render();
  }

  // On a narrow screen the conversations are an overlay the header's button opens.
  function showSidebar(open) {
    document.body.classList.toggle("sidebar-open", open);
    $("sidebar-toggle").setAttribute("aria-expanded", String(open));
  }

  function remove(id) {
    if (state.running && state.running.chat.id === id) state.running.controller.abort();
    state.chats = state.chats.filter((c) => c.id !== id);
    if (state.current === id) state.current = null;
    save();
    render();
  }

  // ---------------------------------------------------------------- settings

  function bindSettings() {
    for (const [key, id] of Object.entries(FIELDS)) {
      const field = $(id);
      field.value = state.settings[key] ?? "";
      field.addEventListener("input", () => {
        state.settings[key] = field.value;
        saveSettings();
        checkSettings();
      });
    }
    const thinking = $("thinking");
    thinking.checked = !!state.settings.thinking;
    thinking.addEventListener("change", () => {
      state.settings.thinking = thinking.checked;
      saveSettings();
    });
    checkSettings();
  }

  function checkSettings() {
    const problems = [];
    for (const [name, key] of [["JSON schema", "schema"], ["tools", "tools"]]) {
      const text = (state.settings[key] || "").trim();
      if (!text) continue;
      try { JSON.parse(text); } catch (err) { problems.push(`The ${name} setting is not valid JSON: ${err.message}`); }
    }
    const node = $("settings-error");
    node.hidden = !problems.length;
    node.textContent = problems.join("\n");
  }

  // ---------------------------------------------------------------- start

  function start() {
    state.chats = readJson(localStorage, STORE, []).filter((c) => c && Array.isArray(c.messages));
    state.current = readJson(localStorage, CURRENT, null);
    if (!chatById(state.current)) state.current = null;
    state.settings = readJson(localStorage, SETTINGS, {});
    // a reply cut short by a reload is kept as it was
    for (const chat of state.chats) {
      for (const m of chat.messages) {
        if (m.role === "assistant" && m.stats && !m.stats.finish && !m.error) m.stats.finish = "stopped";
      }
    }
    bindSettings();
    $("forget-key").hidden = !sessionStorage.getItem(KEY);
    $("forget-key").onclick = () => { sessionStorage.removeItem(KEY); $("forget-key").hidden = true; };
    $("new-chat").onclick = () => {
      state.current = null;
      save();
      showSidebar(false);
      render();
      $("input").focus();
    };
    $("sidebar-toggle").onclick = () => showSidebar(!document.body.classList.contains("sidebar-open"));
    // a tap beside the overlay closes it
    document.querySelector("main").addEventListener("click", (ev) => {
      if (!ev.target.closest("#sidebar-toggle")) showSidebar(false);
    });
    document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") showSidebar(false); });
    $("send").onclick = send;
    $("stop").onclick = () => { if (state.running) state.running.controller.abort(); };
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    });
    $("settings-toggle").onclick = () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    };
    $("messages").addEventListener("click", (ev) => {
      const button = ev.target.closest(".copy");
      if (!button) return;
      const code = button.closest(".code-block").querySelector("code").textContent;
      navigator.clipboard.writeText(code).then(
        () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1200); },
        () => { button.textContent = "Copy failed"; },
      );
    });
    render();
    loadModel().then(render);
    document.body.dataset.ready = "1";
  }

  start();
})();
