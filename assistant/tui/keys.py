"""Key bindings whose footer text follows the interface language, with public Textual API only.

Textual has no public way to change a binding's description. So each key is
bound once per language, to `in_lang('<lang>', '<action>')`, and
`check_action` hides the bindings of the other language: the footer shows
the interface language's text and the key runs the same action either way.

    class CauseList(LocalizedBindings, ListView):
        BINDINGS = bilingual("c", "copy_fix", "key.copy_fix", "causes.copy_fix")
"""

from __future__ import annotations

from textual.binding import Binding

from assistant.i18n import LANGS
from assistant.tui.strings import tr


def bilingual(
    keys: str,
    action: str,
    text_key: str,
    binding_id: str,
    *,
    show: bool = True,
    priority: bool = False,
) -> list[Binding]:
    """One binding per language for `keys` -> `action`; ids are `<binding_id>` and `<binding_id>.zh`."""
    return [
        Binding(
            keys,
            f"in_lang({lang!r}, {action!r})",
            tr(text_key, lang),
            show=show,
            priority=priority,
            id=binding_id if lang == "en" else f"{binding_id}.{lang}",
        )
        for lang in LANGS
    ]


class LocalizedBindings:
    """Mixin for a DOM node with `bilingual` bindings: shows and runs those of `app.lang`."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "in_lang":
            return parameters[0] == getattr(self.app, "lang", "en")
        return super().check_action(action, parameters)

    async def action_in_lang(self, lang: str, action: str) -> None:
        await self.run_action(action)
