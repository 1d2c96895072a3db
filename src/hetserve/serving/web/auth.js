// The API key prompt under the header: opened by its button or by a 401 from the server.
import { $ } from "./dom.js";
import { apiKey, forgetApiKey, setApiKey } from "./storage.js";

export function showAuth(message) {
  const box = $("auth");
  box.hidden = false;
  $("key-toggle").setAttribute("aria-expanded", "true");
  const err = $("auth-error");
  err.hidden = false;
  err.textContent = (apiKey() ? "The server refused the API key" : "This server needs an API key") +
    (message ? ": " + message : "") + ". Enter it below.";
  $("api-key").focus();
}

function hideAuth() {
  $("auth").hidden = true;
  $("auth-error").hidden = true;
  $("key-toggle").setAttribute("aria-expanded", "false");
}

// onSaved(): called once a key is saved (or an empty one removed) and the prompt closed.
export function initAuth(onSaved) {
  $("key-toggle").addEventListener("click", () => {
    if ($("auth").hidden) {
      $("auth").hidden = false;
      $("key-toggle").setAttribute("aria-expanded", "true");
      $("api-key").value = apiKey();
      $("api-key").focus();
    } else {
      hideAuth();
    }
  });

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey($("api-key").value.trim());
    $("api-key").value = "";
    hideAuth();
    onSaved();
  });

  $("key-clear").addEventListener("click", () => {
    forgetApiKey();
    $("api-key").value = "";
    $("api-key").focus();
  });
}
