"""Interface strings of the chat, in English and Chinese.

Shared result words (verdicts, stances, section names) and the rules for
choosing a language live in assistant.i18n; this table holds only what the
chat itself says, looked up by the same `translate`.
"""

from __future__ import annotations

from assistant.i18n import translate

UI: dict[str, dict[str, str]] = {
    "app.title": {"en": "DDP assistant", "zh": "DDP 助手"},
    "lang.name": {"en": "English", "zh": "中文"},
    "model.loading": {"en": "loading the model… {seconds}s", "zh": "正在加载模型… {seconds}秒"},
    "model.ready": {"en": "model ready", "zh": "模型已就绪"},
    "model.failed": {"en": "model failed: {error}", "zh": "模型加载失败：{error}"},
    "input.placeholder": {
        "en": "Paste an error or a whole log, or ask a question. Enter sends.",
        "zh": "粘贴报错或整段日志，或直接提问。回车发送。",
    },
    "input.empty": {
        "en": "Nothing to send: paste an error message or a log, or type a question.",
        "zh": "没有可发送的内容：请粘贴报错或日志，或输入问题。",
    },
    "input.queued": {
        "en": "The model is still loading; your question will be answered when it is ready.",
        "zh": "模型仍在加载，就绪后会立即回答你的问题。",
    },
    "input.large_paste": {
        "en": "⟦pasted text #{number}: {lines} lines, {size}⟧",
        "zh": "⟦粘贴的文本 #{number}：{lines} 行，{size}⟧",
    },
    "input.large_paste_one_line": {
        "en": "⟦pasted text #{number}: one line, {size}⟧",
        "zh": "⟦粘贴的文本 #{number}：1 行，{size}⟧",
    },
    "welcome": {
        "en": (
            "Paste the error from your failing job (one line or the whole multi-rank log) "
            "and press Enter. The likely causes appear at once; probes then check them on "
            "this machine.\nctrl+p opens the commands: doctor, lint a script, rebuild the "
            "knowledge base, export, history."
        ),
        "zh": (
            "把失败任务的报错粘贴进来（一行或整段多 rank 日志），按回车。"
            "可能的原因会立即列出，随后探针会在本机逐一验证。\n"
            "ctrl+p 打开命令：环境体检、检查训练脚本、重建知识库、导出、历史记录。"
        ),
    },
    "turn.doctor": {"en": "doctor: check this machine", "zh": "环境体检：检查本机"},
    "turn.lint": {"en": "lint {path}", "zh": "检查脚本 {path}"},
    "turn.lines": {"en": "[{count} lines]", "zh": "[{count} 行]"},
    "turn.confidence": {"en": "{level}", "zh": "{level}"},
    "turn.waiting_model": {
        "en": "Waiting for the model to load…",
        "zh": "等待模型加载…",
    },
    "turn.searching": {"en": "Searching the knowledge base…", "zh": "正在检索知识库…"},
    "turn.linting": {"en": "Checking the script…", "zh": "正在检查脚本…"},
    "turn.probing": {
        "en": "Checking on this machine: {done} probe(s) done, {running} running…",
        "zh": "正在本机检查：已完成 {done} 个探针，{running} 个运行中…",
    },
    "turn.no_probes": {
        "en": "No probe applies to these causes.",
        "zh": "这些原因没有可运行的探针。",
    },
    "turn.done": {
        "en": "{confirmed} confirmed, {ruled_out} ruled out, {other} open.",
        "zh": "确认 {confirmed} 个，排除 {ruled_out} 个，待定 {other} 个。",
    },
    "turn.error": {"en": "Failed: {error}", "zh": "失败：{error}"},
    "turn.from_earlier": {
        "en": "(follow-up to your earlier question)",
        "zh": "（接着上一个问题）",
    },
    "turn.probes_failed": {
        "en": "Probes failed: {error}",
        "zh": "探针运行失败：{error}",
    },
    "turn.open_hint": {
        "en": "Tab: causes · Enter: open · c: copy fix",
        "zh": "Tab 切到原因 · 回车查看 · c 复制修复",
    },
    "lint.none": {"en": "No problem found in {path}.", "zh": "{path} 中没有发现问题。"},
    "lint.found": {"en": "{count} finding(s) in {path}:", "zh": "{path} 中发现 {count} 个问题："},
    "probe.label": {"en": "Probes", "zh": "探针"},
    "probe.waiting": {"en": "waiting", "zh": "等待中"},
    "probe.running": {"en": "running {seconds}", "zh": "运行中 {seconds}"},
    "probe.reused": {"en": "earlier", "zh": "沿用"},
    "probe.status.ok": {"en": "ok", "zh": "完成"},
    "probe.status.failed": {"en": "failed", "zh": "失败"},
    "probe.status.timeout": {"en": "timed out", "zh": "超时"},
    "probe.status.not_applicable": {"en": "not applicable", "zh": "不适用"},
    "probe.status.error": {"en": "error", "zh": "出错"},
    "probe.status.interrupted": {"en": "interrupted", "zh": "已中断"},
    "detail.summary": {"en": "Summary", "zh": "概要"},
    "detail.agreeing": {"en": "Agreeing", "zh": "认同的回答"},
    "detail.contradicting": {"en": "Contradicting", "zh": "相互矛盾的回答"},
    "detail.none": {"en": "(none)", "zh": "（无）"},
    "detail.no_answers": {
        "en": "No community answer claims this cause.",
        "zh": "没有社区回答提到这个原因。",
    },
    "detail.no_evidence": {
        "en": "No probe has reported on this cause yet.",
        "zh": "还没有探针给出这个原因的结果。",
    },
    "detail.loading": {"en": "Loading the entry…", "zh": "正在读取条目…"},
    "detail.partial": {
        "en": "The full entry is not available ({error}); showing what retrieval returned.",
        "zh": "无法读取完整条目（{error}），以下为检索结果中的内容。",
    },
    "copied": {"en": "Fix copied to the clipboard.", "zh": "修复代码已复制到剪贴板。"},
    "nothing_to_copy": {"en": "This cause has no fix to copy.", "zh": "这个原因没有可复制的修复。"},
    "history.title": {"en": "Conversation history", "zh": "历史对话"},
    "history.empty": {"en": "No saved conversation yet.", "zh": "还没有保存的对话。"},
    "history.turns": {"en": "{count} turn(s)", "zh": "{count} 轮"},
    "history.deleted": {"en": "Conversation deleted.", "zh": "对话已删除。"},
    "history.confirm_delete": {
        "en": "Press d again to delete this conversation (it cannot be undone).",
        "zh": "再按一次 d 删除这段对话（无法恢复）。",
    },
    "history.unavailable": {
        "en": "History is not available: {error}",
        "zh": "历史记录不可用：{error}",
    },
    "lint.prompt": {
        "en": "Path of the training script to lint:",
        "zh": "要检查的训练脚本路径：",
    },
    "lint.prompt_hint": {"en": "Enter checks · Esc cancels", "zh": "回车检查 · Esc 取消"},
    "lint.empty_path": {"en": "Type a path first.", "zh": "请先输入路径。"},
    "rebuild.started": {"en": "Rebuilding the knowledge base…", "zh": "正在重建知识库…"},
    "rebuild.done": {"en": "Knowledge base rebuilt: {summary}", "zh": "知识库已重建：{summary}"},
    "rebuild.failed": {"en": "Rebuild failed: {error}", "zh": "重建失败：{error}"},
    "export.done": {
        "en": "Conversation exported to {path} and copied to the clipboard.",
        "zh": "对话已导出到 {path}，并已复制到剪贴板。",
    },
    "export.empty": {"en": "Nothing to export yet.", "zh": "还没有可导出的内容。"},
    "new.done": {"en": "New conversation.", "zh": "新对话。"},
    "export.unwritable": {
        "en": "Cannot write the report to {path}: {reason}. Save it elsewhere:",
        "zh": "无法把报告写入 {path}：{reason}。换个位置保存：",
    },
    "export.other_path": {"en": "Another folder or file…", "zh": "其他文件夹或文件…"},
    "export.home": {"en": "My home folder ({path})", "zh": "我的主目录（{path}）"},
    "export.clipboard": {"en": "Copy to the clipboard only", "zh": "只复制到剪贴板"},
    "export.copied": {
        "en": "Report copied to the clipboard (not saved to a file).",
        "zh": "报告已复制到剪贴板（未保存为文件）。",
    },
    "export.prompt": {
        "en": "Folder (or .md file) for the report:",
        "zh": "报告保存到的文件夹（或 .md 文件）：",
    },
    "history.notice": {
        "en": (
            "Conversations, pasted logs included, are kept on this machine in {path} "
            "(readable only by you). Ctrl+P 'Clear history' empties it; "
            "`assistant chat --no-history` or ASSISTANT_NO_HISTORY=1 keeps nothing."
        ),
        "zh": (
            "对话（包括粘贴的日志）保存在本机 {path}（仅你本人可读）。"
            "Ctrl+P “清空历史记录”可清空；`assistant chat --no-history` 或 "
            "ASSISTANT_NO_HISTORY=1 则不保存。"
        ),
    },
    "history.off": {
        "en": "History is off for this session (--no-history or ASSISTANT_NO_HISTORY).",
        "zh": "本次会话不保存历史记录（--no-history 或 ASSISTANT_NO_HISTORY）。",
    },
    "history.confirm_clear": {
        "en": "Delete every saved conversation ({count})? This cannot be undone.",
        "zh": "删除全部已保存的对话（{count} 段）？无法恢复。",
    },
    "history.cleared": {"en": "History cleared.", "zh": "历史记录已清空。"},
    "confirm.yes": {"en": "Delete all", "zh": "全部删除"},
    "confirm.no": {"en": "Keep", "zh": "保留"},
    "confirm.hint": {"en": "y deletes · n or Esc keeps", "zh": "y 删除 · n 或 Esc 保留"},
    "cmd.clear_history": {"en": "Clear history", "zh": "清空历史记录"},
    "cmd.clear_history.help": {
        "en": "Delete every saved conversation (pasted logs included)",
        "zh": "删除全部已保存的对话（包括粘贴的日志）",
    },
    "key.clear": {"en": "Clear all", "zh": "全部清空"},
    "key.yes": {"en": "Delete", "zh": "删除"},
    "key.no": {"en": "Keep", "zh": "保留"},
    "busy.quit": {"en": "Stopping probes…", "zh": "正在停止探针…"},
    "cmd.doctor": {"en": "Run doctor", "zh": "运行环境体检"},
    "cmd.doctor.help": {
        "en": "Run every probe on this machine and report what is wrong",
        "zh": "在本机运行全部探针并报告问题",
    },
    "cmd.lint": {"en": "Lint a training script", "zh": "检查训练脚本"},
    "cmd.lint.help": {
        "en": "Check a script for known DDP mistakes; findings feed the verdicts",
        "zh": "检查脚本中常见的 DDP 错误，结果会用于判定",
    },
    "cmd.rebuild": {"en": "Rebuild the knowledge base", "zh": "重建知识库"},
    "cmd.rebuild.help": {
        "en": "Recompile the index from kb/ (after editing the KB files)",
        "zh": "根据 kb/ 重新编译索引（修改知识库文件之后）",
    },
    "cmd.language": {"en": "Switch language", "zh": "切换语言"},
    "cmd.language.help": {"en": "English / 中文", "zh": "English / 中文"},
    "cmd.export": {"en": "Export the conversation as Markdown", "zh": "导出对话为 Markdown"},
    "cmd.export.help": {
        "en": "Root error, environment facts, verdicts and fix, ready for an issue tracker",
        "zh": "包含根本错误、环境信息、判定和修复方法，可直接贴到问题追踪系统",
    },
    "cmd.history": {"en": "Conversation history", "zh": "历史对话"},
    "cmd.history.help": {
        "en": "Browse, reopen or delete saved conversations",
        "zh": "浏览、打开或删除已保存的对话",
    },
    "cmd.new": {"en": "New conversation", "zh": "新对话"},
    "cmd.new.help": {"en": "Start over with an empty conversation", "zh": "清空并开始新对话"},
    # Footer descriptions, by binding id.
    "key.send": {"en": "Send", "zh": "发送"},
    "key.causes": {"en": "Causes", "zh": "原因"},
    "key.input": {"en": "Back to input", "zh": "回到输入框"},
    "key.newline": {"en": "Newline", "zh": "换行"},
    "key.language": {"en": "中文", "zh": "English"},
    "key.history": {"en": "History", "zh": "历史"},
    "key.new": {"en": "New", "zh": "新对话"},
    "key.quit": {"en": "Quit", "zh": "退出"},
    "key.export": {"en": "Export", "zh": "导出"},
    "key.open": {"en": "Open cause", "zh": "查看原因"},
    "key.copy_fix": {"en": "Copy fix", "zh": "复制修复"},
    "key.fixed": {"en": "Fixed it", "zh": "已解决"},
    "key.wrong": {"en": "Wrong cause", "zh": "原因不对"},
    "cmd.run": {"en": "Run a launch command", "zh": "运行启动命令"},
    "cmd.run.help": {
        "en": "Run your torchrun (or python) command, watch it, and get the answer if it fails",
        "zh": "运行你的 torchrun（或 python）命令并观察；失败或卡住时给出诊断",
    },
    "run.prompt": {
        "en": "Launch command to run and watch (never through a shell):",
        "zh": "要运行并观察的启动命令（不经过 shell）：",
    },
    "run.prompt_hint": {"en": "Enter runs · Esc cancels", "zh": "回车运行 · Esc 取消"},
    "run.empty": {"en": "Type a command first.", "zh": "请先输入命令。"},
    "run.running": {
        "en": "The job is running… {seconds} (a new run or quitting stops it)",
        "zh": "任务运行中… {seconds}（新的运行或退出会停止它）",
    },
    "run.logs": {"en": "logs: {path}", "zh": "日志：{path}"},
    "run.hung": {"en": "The job hung: {summary}", "zh": "任务卡住了：{summary}"},
    "run.finished": {
        "en": "The job exited with code {code} after {seconds}: nothing to diagnose.",
        "zh": "任务在 {seconds} 后以退出码 {code} 结束：无需诊断。",
    },
    "run.cancelled": {
        "en": "The job was stopped after {seconds}.",
        "zh": "任务在 {seconds} 后被停止。",
    },
    "feedback.fixed": {
        "en": "Thanks: {cause} fixed it (answer {answer}), kept for the KB's maintainers.",
        "zh": "谢谢：已记录 {cause} 解决了问题（回答 {answer}），供知识库维护者参考。",
    },
    "feedback.wrong": {
        "en": "Thanks: {cause} noted as the wrong cause (answer {answer}).",
        "zh": "谢谢：已记录 {cause} 不是原因（回答 {answer}）。",
    },
    "feedback.confirm_fixed": {
        "en": "Press f again to record that {cause} fixed it.",
        "zh": "再按一次 f，记录 {cause} 解决了问题。",
    },
    "feedback.confirm_wrong": {
        "en": "Press w again to record that {cause} is the wrong cause.",
        "zh": "再按一次 w，记录 {cause} 不是原因。",
    },
    "feedback.off": {
        "en": "History is off for this session: answers are not kept, so there is no feedback.",
        "zh": "本次会话未开启历史记录：不保存回答，因此无法反馈。",
    },
    "feedback.not_kept": {
        "en": "This answer was not kept (it is not finished yet, or came from before).",
        "zh": "这个回答没有被保存（尚未完成，或来自之前的记录）。",
    },
    "feedback.failed": {"en": "Feedback not kept: {error}", "zh": "反馈未保存：{error}"},
    "key.reopen": {"en": "Open", "zh": "打开"},
    "key.back": {"en": "Back", "zh": "返回"},
    "key.delete": {"en": "Delete", "zh": "删除"},
    "key.cancel": {"en": "Cancel", "zh": "取消"},
}


def tr(key: str, lang: str = "en", **values: object) -> str:
    """The string `key` in `lang` (English when missing), formatted with `values`."""
    return translate(UI, key, lang, **values)


def command_title(key: str, lang: str) -> str:
    """A palette command's title: in Chinese with its English name beside it.

    The palette matches what it shows, so a person who knows the English
    name (from the README, a colleague) still finds the command in Chinese.
    """
    english = tr(key, "en")
    return english if lang == "en" else f"{tr(key, lang)} · {english}"
