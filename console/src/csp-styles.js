// The console's CSP is `style-src 'self'`: no <style> element and no `style`
// attribute written by script is applied. The terminal emulator (xterm.js's
// DOM renderer) writes its theme and row sizes into <style> elements and a
// few cell colours into `style` attributes. This module, imported before it,
// routes both through the CSS object model, which the policy allows (and
// which only this page's own script can reach):
//   - a <style> element is replaced by an inert element whose text goes into
//     a constructed stylesheet adopted by the document while it exists;
//   - setAttribute("style", text) becomes `element.style.cssText = text`.
// The console's own code writes neither; nothing from a sandbox is ever
// parsed as CSS here except through xterm's own escaping of colours.

const createElement = Document.prototype.createElement;
Document.prototype.createElement = function createElementCspSafe(name, options) {
  if (String(name).toLowerCase() !== "style") return createElement.call(this, name, options);
  const doc = this;
  const el = createElement.call(doc, "aviary-style");
  el.hidden = true;
  const sheet = new CSSStyleSheet();
  let text = "";
  let adopted = false;
  const adopt = () => {
    if (!adopted) {
      doc.adoptedStyleSheets = [...doc.adoptedStyleSheets, sheet];
      adopted = true;
    }
  };
  Object.defineProperty(el, "textContent", {
    configurable: true,
    get: () => text,
    set: (value) => {
      text = value == null ? "" : String(value);
      sheet.replaceSync(text);
      adopt();
    },
  });
  Object.defineProperty(el, "sheet", { configurable: true, get: () => sheet });
  // harmless attributes some callers set on a <style>
  el.type = "text/css";
  el.media = "";
  const remove = el.remove.bind(el);
  el.remove = () => {
    doc.adoptedStyleSheets = doc.adoptedStyleSheets.filter((s) => s !== sheet);
    adopted = false;
    remove();
  };
  return el;
};

const setAttribute = Element.prototype.setAttribute;
Element.prototype.setAttribute = function setAttributeCspSafe(name, value) {
  if (String(name).toLowerCase() === "style" && this.style) {
    this.style.cssText = String(value);
    return;
  }
  setAttribute.call(this, name, value);
};
