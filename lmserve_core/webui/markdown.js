// A compact Markdown renderer and code highlighter for the chat page.
// Everything the model wrote is escaped first; the only markup that comes out is made here
// (links only to http, https and mailto). Covers what chat replies use: headings,
// paragraphs, emphasis, inline and fenced code (an unclosed fence, as while streaming,
// runs to the end), lists (nested by indentation), block quotes, tables and rules.
"use strict";

const LmMarkdown = (() => {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escape = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

  // ------------------------------------------------------------------ highlighting

  const C_LIKE = "break case catch class const continue default do else enum extends false final finally for goto if import in instanceof new null private protected public return static struct super switch this throw throws true try typedef union unsigned void volatile while sizeof int long short char float double bool auto signed extern inline namespace template typename using virtual override nullptr delete operator friend mutable constexpr";
  const LANGS = {
    js: {
      words: "async await break case catch class const continue debugger default delete do else export extends false finally for from function if import in instanceof let new null of return static super switch this throw true try typeof undefined var void while with yield interface type implements enum readonly keyof as",
      line: "//", block: true, quotes: "\"'`",
    },
    py: {
      words: "and as assert async await break class continue def del elif else except False finally for from global if import in is lambda None nonlocal not or pass raise return True try while with yield match case self",
      line: "#", quotes: "\"'", triple: true,
    },
    c: { words: C_LIKE, line: "//", block: true, quotes: "\"'" },
    go: {
      words: "break case chan const continue default defer else fallthrough for func go goto if import interface map package range return select struct switch type var nil true false",
      line: "//", block: true, quotes: "\"'`",
    },
    rust: {
      words: "as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move mut pub ref return self Self static struct super trait true type unsafe use where while Some None Ok Err",
      line: "//", block: true, quotes: "\"",
    },
    sh: {
      words: "if then else elif fi case esac for while until do done in function return local export set unset echo cd exit source",
      line: "#", quotes: "\"'",
    },
    sql: {
      words: "select from where and or not insert into values update set delete create table drop alter index join left right inner outer on group by order having limit offset as distinct union all null is primary key foreign references default case when then else end",
      line: "--", block: true, quotes: "'\"", nocase: true,
    },
    json: { words: "true false null", quotes: "\"" },
    yaml: { words: "true false null yes no", line: "#", quotes: "\"'" },
  };
  const ALIASES = {
    javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js", mjs: "js",
    python: "py", python3: "py", c: "c", h: "c", cpp: "c", "c++": "c", cc: "c", hpp: "c",
    java: "c", cs: "c", csharp: "c", kotlin: "c", swift: "c", php: "c", golang: "go", rs: "rust",
    bash: "sh", shell: "sh", zsh: "sh", console: "sh", jsonc: "json", yml: "yaml", toml: "yaml",
  };
  const compiled = {};

  function grammar(lang) {
    const name = ALIASES[lang] || lang;
    const spec = LANGS[name];
    if (!spec) return null;
    if (compiled[name]) return compiled[name];
    const parts = [];
    const never = "((?!))";  // keeps the group numbers when a language lacks a kind of comment
    parts.push(spec.block ? "(\\/\\*[\\s\\S]*?(?:\\*\\/|$))" : never);
    parts.push(spec.line ? "(" + spec.line.replace(/[/#-]/g, "\\$&") + "[^\\n]*)" : never);
    const strings = [];
    if (spec.triple) strings.push('"""[\\s\\S]*?(?:"""|$)', "'''[\\s\\S]*?(?:'''|$)");
    for (const q of spec.quotes) {
      const body = q === "`" ? "[^\\\\`]" : "[^\\\\\\n" + q + "]";  // template strings span lines
      strings.push(q + "(?:\\\\[\\s\\S]|" + body + ")*(?:" + q + "|$)");
    }
    parts.push("(" + strings.join("|") + ")");
    parts.push("(\\b(?:0[xX][0-9a-fA-F_]+|\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b)");
    parts.push("([A-Za-z_$][\\w$]*)");
    const words = new Set(spec.words.split(" ").map((w) => (spec.nocase ? w.toLowerCase() : w)));
    compiled[name] = { re: new RegExp(parts.join("|"), "g"), words, nocase: !!spec.nocase };
    return compiled[name];
  }

  function highlight(code, lang) {
    const g = grammar((lang || "").toLowerCase());
    if (!g) return escape(code);
    let out = "";
    let last = 0;
    g.re.lastIndex = 0;
    for (let m = g.re.exec(code); m; m = g.re.exec(code)) {
      if (m[0] === "") { g.re.lastIndex++; continue; }
      out += escape(code.slice(last, m.index));
      last = m.index + m[0].length;
      let cls = null;
      if (m[1] || m[2]) cls = "tok-comment";
      else if (m[3]) cls = "tok-string";
      else if (m[4]) cls = "tok-number";
      else if (m[5]) {
        const word = g.nocase ? m[5].toLowerCase() : m[5];
        if (g.words.has(word)) cls = "tok-keyword";
        else if (code[last] === "(") cls = "tok-function";
      }
      out += cls ? `<span class="${cls}">${escape(m[0])}</span>` : escape(m[0]);
    }
    return out + escape(code.slice(last));
  }

  // ------------------------------------------------------------------ inline

  function safeUrl(url) {
    const u = url.trim();
    return /^(https?:\/\/|mailto:)/i.test(u) ? u : null;
  }

  function inline(text) {
    const held = [];
    const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
    let s = String(text).replace(/\u0000/g, "");
    // code spans first: nothing inside them is markup
    s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) =>
      hold(`<code>${escape(code.replace(/^ (.*) $/, "$1"))}</code>`));
    // links: [text](url), and bare http(s) URLs
    s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)(?:\s+"[^"]*")?\)/g, (all, label, url) => {
      const href = safeUrl(url);
      if (!href) return all;
      return hold(`<a href="${escape(href)}" target="_blank" rel="noopener noreferrer">${inlineMarks(escape(label))}</a>`);
    });
    s = s.replace(/\bhttps?:\/\/[^\s<>()]+[^\s<>().,;:!?'"]/g, (url) =>
      hold(`<a href="${escape(url)}" target="_blank" rel="noopener noreferrer">${escape(url)}</a>`));
    s = inlineMarks(escape(s));
    s = s.replace(/\n/g, "<br>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  }

  function inlineMarks(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  // ------------------------------------------------------------------ blocks

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function startsBlock(line, next) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_RULE.test(next));
  }

  function codeBlock(code, lang) {
    const label = lang ? `<span class="code-lang">${escape(lang)}</span>` : "";
    return `<div class="code-block"><div class="code-head">${label}<button type="button" class="copy" title="Copy">Copy</button></div>` +
      `<pre><code${lang ? ` class="language-${escape(lang)}"` : ""}>${highlight(code, lang)}</code></pre></div>`;
  }

  function cells(row) {
    return row.trim().replace(/^\|/, "").replace(/\|$/, "").split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(rows) {
    const head = cells(rows[0]);
    const aligns = cells(rows[1]).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""));
    const cell = (tag, text, i) => `<${tag}${aligns[i] ? ` class="align-${aligns[i]}"` : ""}>${inline(text)}</${tag}>`;
    let html = "<table><thead><tr>" + head.map((c, i) => cell("th", c, i)).join("") + "</tr></thead><tbody>";
    for (const row of rows.slice(2)) html += "<tr>" + cells(row).map((c, i) => cell("td", c, i)).join("") + "</tr>";
    return html + "</tbody></table>";
  }

  function list(lines) {
    const first = ITEM.exec(lines[0]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const start = ordered ? parseInt(first[2], 10) : 1;
    const items = [];
    for (const line of lines) {
      const m = ITEM.exec(line);
      if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) items.push([m[3]]);
      else items[items.length - 1].push(line.replace(new RegExp(`^ {0,${indent + 4}}`), ""));
    }
    const tag = ordered ? "ol" : "ul";
    const attr = ordered && start !== 1 ? ` start="${start}"` : "";
    const body = items.map((item) => {
      const inner = item.length === 1 ? inline(item[0]) : blocks(item.join("\n"), true);
      return `<li>${inner}</li>`;
    }).join("");
    return `<${tag}${attr}>${body}</${tag}>`;
  }

  function blocks(src, tight) {
    const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
        const code = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) code.push(lines[i]);
        i++;
        out.push(codeBlock(code.join("\n"), m[2]));
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
        out.push(`<blockquote>${blocks(quoted.join("\n"))}</blockquote>`);
      } else if (ITEM.test(line)) {
        const items = [];
        const head = ITEM.exec(line);
        const indent = head[1].length;
        const ordered = /\d/.test(head[2]);
        for (; i < lines.length; i++) {
          const l = lines[i];
          if (!l.trim()) {
            // a blank line ends the list unless an item or an indented line follows
            const next = lines[i + 1];
            if (next !== undefined && (ITEM.test(next) || /^\s{2,}\S/.test(next))) { items.push(""); continue; }
            break;
          }
          const im = ITEM.exec(l);
          if (!im && !/^\s/.test(l) && items.length && startsBlock(l, lines[i + 1])) break;
          if (im && (im[1].length < indent || (im[1].length <= indent + 1 && /\d/.test(im[2]) !== ordered))) break;
          items.push(l);
        }
        while (items.length && items[items.length - 1] === "") items.pop();
        out.push(list(items));
      } else if (line.includes("|") && lines[i + 1] !== undefined && TABLE_RULE.test(lines[i + 1])) {
        const rows = [line, lines[i + 1]];
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) rows.push(lines[i]);
        out.push(table(rows));
      } else {
        const para = [line];
        for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1]); i++) para.push(lines[i]);
        const html = inline(para.join("\n"));
        out.push(tight && out.length === 0 ? html : `<p>${html}</p>`);
      }
    }
    return out.join("");
  }

  return { render: (src) => blocks(src, false), highlight, escape };
})();
