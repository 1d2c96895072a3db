// Calls to the server's /v1 API: the Bearer key, error bodies, reading a streamed (SSE) answer,
// and the served model.
import { $ } from "./dom.js";
import { apiKey } from "./storage.js";
import { showAuth } from "./auth.js";

export class AuthError extends Error {}

export async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
    return JSON.stringify(body);
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

// fetch() of /v1/... with the Bearer key; a 401 opens the key prompt and throws AuthError.
export async function api(path, opts) {
  opts = Object.assign({}, opts || {});
  const headers = Object.assign({}, opts.headers || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  opts.headers = headers;
  const resp = await fetch(path, opts);
  if (resp.status === 401) {
    const msg = await errorMessage(resp);
    showAuth(msg);
    throw new AuthError(msg);
  }
  return resp;
}

// Parse an SSE body: calls onEvent(obj) for each data line's JSON; returns when [DONE] or the body ends.
export async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, cut).replace(/\r$/, "");
        buf = buf.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        if (data) onEvent(JSON.parse(data));
      }
    }
  } catch (e) {
    reader.cancel().catch(() => {}); // an error event or a bad line: stop reading (the server aborts)
    throw e;
  }
}

// The served model's id (null until /v1/models answers), shown in the header and the title.
export let modelId = null;

export async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const body = await resp.json();
    modelId = body.data && body.data[0] ? body.data[0].id : null;
    $("model-name").textContent = modelId || "";
    document.title = modelId ? "hetserve: " + modelId : "hetserve";
  } catch (e) {
    if (!(e instanceof AuthError)) $("model-name").textContent = "server unreachable";
  }
}
