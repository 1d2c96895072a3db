// What the page keeps in this browser's localStorage: the API key, the conversations and the
// sampling settings. A value that cannot be read or written falls back to its default.

const KEY_STORE = "hetserve.apiKey";
const CONV_STORE = "hetserve.conversations";
const CURRENT_STORE = "hetserve.current";
const SETTINGS_STORE = "hetserve.settings";

function load(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v === null ? fallback : JSON.parse(v);
  } catch (_) {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (_) { /* storage full or disabled: the page still works for this visit */ }
}

// The key is stored as it is (not JSON), "" when there is none.
export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

export function forgetApiKey() {
  localStorage.removeItem(KEY_STORE);
}

// The conversations, most recent first, and the id of the open one.
export function loadConversations() {
  let convs = load(CONV_STORE, []);
  if (!Array.isArray(convs)) convs = [];
  return { convs, current: load(CURRENT_STORE, null) };
}

export function saveConversations(convs, current) {
  save(CONV_STORE, convs);
  save(CURRENT_STORE, current);
}

// The sampling fields as typed: { "temperature": "0.7", "top-p": "", ... } by input id.
export function loadSettings() {
  return load(SETTINGS_STORE, {});
}

export function saveSettings(settings) {
  save(SETTINGS_STORE, settings);
}
