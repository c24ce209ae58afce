// Search over the KB without a server: the index is a script (search-index.js)
// that sets window.KB_SEARCH, so the site also works opened from disk.
// Results are built with textContent only: KB text never becomes markup.
(function () {
  "use strict";
  var body = document.body;
  var root = body.getAttribute("data-root") || "";
  var lang = body.getAttribute("data-lang") || "en";
  var input = document.getElementById("search");
  var list = document.getElementById("results");
  var entries = window.KB_SEARCH || [];
  var MAX_RESULTS = 20;
  var KIND_ORDER = { cause: 0, thread: 1 };
  if (!input || !list) return;

  // Lowercase, and "-" as a space: "duplicate gpu" finds the id duplicate-gpu-per-rank.
  function normal(text) {
    return text.toLowerCase().replace(/-/g, " ").replace(/\s+/g, " ").trim();
  }

  function terms(query) {
    return normal(query).split(" ").filter(function (t) { return t.length > 0; });
  }

  // Every term must occur; a term in the title or id counts more than one in the
  // text, and the whole query as written in the title or id counts most.
  function score(entry, words) {
    var total = entry.head.indexOf(words.join(" ")) >= 0 ? 5 : 0;
    for (var i = 0; i < words.length; i++) {
      var word = words[i];
      if (entry.text.indexOf(word) < 0) return 0;
      total += entry.head.indexOf(word) >= 0 ? 3 : 1;
    }
    return total;
  }

  function search(query) {
    var words = terms(query);
    if (!words.length) return [];
    var hits = [];
    for (var i = 0; i < entries.length; i++) {
      var s = score(entries[i], words);
      if (s > 0) hits.push([s, entries[i]]);
    }
    // Best first; on a tie a cause (the answer) before a thread (a discussion of it).
    hits.sort(function (a, b) {
      return b[0] - a[0] || KIND_ORDER[a[1].kind] - KIND_ORDER[b[1].kind] || (a[1].id < b[1].id ? -1 : 1);
    });
    return hits.slice(0, MAX_RESULTS).map(function (hit) { return hit[1]; });
  }

  function show(results) {
    while (list.firstChild) list.removeChild(list.firstChild);
    results.forEach(function (entry) {
      var item = document.createElement("li");
      var link = document.createElement("a");
      link.href = root + (lang === "zh" ? "zh/" : "") + entry.path;
      link.textContent = (lang === "zh" && entry.title_zh) ? entry.title_zh : entry.title;
      var kind = document.createElement("span");
      kind.className = "kind";
      kind.textContent = entry.kind + " · " + entry.id;
      item.appendChild(link);
      item.appendChild(kind);
      list.appendChild(item);
    });
    list.setAttribute("data-count", String(results.length));
  }

  input.addEventListener("input", function () { show(search(input.value)); });
  input.addEventListener("keydown", function (event) {
    if (event.key === "Enter") {
      var first = list.querySelector("a");
      if (first) window.location.href = first.href;
    }
  });
})();
