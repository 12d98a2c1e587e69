"""mkdocs hook: links from a docs page to a repository file outside docs/.

A page may link `../bench/RESULTS.md` or `../autopar/plan.py`: GitHub shows those files, the site does not hold
them. This hook keeps such a link working in both places: the file must exist (a missing one fails the build,
as mkdocs fails a broken link between pages under --strict), and in the site the link becomes
`extra.repo_blob_url` + the path when mkdocs.yml sets one, else the path as code (`bench/RESULTS.md`).

Example: `[results](../bench/RESULTS.md)` on docs/performance.md -> "results (`bench/RESULTS.md`)".
"""

import os
import re

from mkdocs.exceptions import PluginError

# A markdown link or image: [text](target) or [text](target#anchor); fenced code is skipped below.
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~)")


def _rewrite_line(line, page_dir, docs_dir, root, blob_url, src_uri):
    def fix(m):
        bang, text, target, anchor = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if "://" in target or target.startswith(("mailto:", "/")):
            return m.group(0)
        path = os.path.normpath(os.path.join(page_dir, target))
        if path == docs_dir or path.startswith(docs_dir + os.sep):
            return m.group(0)  # a page or image in the site: mkdocs checks it
        rel = os.path.relpath(path, root)
        if rel.startswith("..") or not os.path.exists(path):
            raise PluginError(f"{src_uri}: the link to {target!r} names no file of the repository ({rel})")
        if bang:
            raise PluginError(f"{src_uri}: the image {target!r} is outside docs/; copy it under docs/images/")
        if blob_url:
            return f"[{text}]({blob_url.rstrip('/')}/{rel}{anchor})"
        return text if text.strip("`") == rel else f"{text} (`{rel}`)"

    return LINK.sub(fix, line)


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.normpath(config["docs_dir"])
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    page_dir = os.path.dirname(page.file.abs_src_path)
    blob_url = config.get("extra", {}).get("repo_blob_url")
    out, in_fence = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        if not in_fence:
            line = _rewrite_line(line, page_dir, docs_dir, root, blob_url, page.file.src_uri)
        out.append(line)
    return "\n".join(out)
