"""Writing-assistant traffic from a seed, no external data: what bench.capacity sends to every system.

A user opens a session by pasting a document (500-1,500 tokens) under the shared system prompt, then takes
3-6 more turns: edits (rewrite, fix or translate one paragraph: the reply mostly repeats the user's text, which
the turn also carries as an OpenAI `prediction`) and writing (continue, expand, draft: open-ended), each reply
100-300 tokens, with think time before each turn. Each session is English or Chinese, an even draw. Everything is
a pure function of (seed, session number): every system gets the same sessions.

Token lengths are counted with the function the caller gives (the model's tokenizer in a run; any counter in
tests), so that "500-1,500 tokens" holds for the model under test.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Counter = Callable[[str], int]

DOCUMENT_TOKENS = (500, 1500)
REPLY_TOKENS = (100, 300)
FOLLOW_UP_TURNS = (2, 5)  # after the paste: 3-6 turns in all
PARAGRAPH_TOKENS = (70, 260)  # an edited paragraph fits a 300-token reply
LANGS = ("en", "zh")


@dataclass(frozen=True)
class Turn:
    kind: str  # "paste" (opens the session with the document), "edit" or "write"
    task: str  # rewrite, fix, translate, summarize, continue, expand, draft
    text: str  # the user's message
    max_tokens: int
    prediction: str | None  # the user's own text, for edits: what the reply mostly repeats
    think_s: float  # the user's pause before sending this turn (0 for the paste)


@dataclass(frozen=True)
class Session:
    name: str
    lang: str
    document_tokens: int
    turns: tuple[Turn, ...]


# -- prose from a grammar ------------------------------------------------------------------------------------
EN = {
    "place": [
        "the town library",
        "the harbour office",
        "the old mill",
        "the night market",
        "the river school",
        "the bakery on Elm Street",
        "the county archive",
        "the community garden",
        "the ferry terminal",
        "the repair café",
        "the railway museum",
        "the hill observatory",
    ],
    "people": [
        "the volunteers",
        "the council",
        "a group of students",
        "the new manager",
        "two retired teachers",
        "the neighbours",
        "a local engineer",
        "the night staff",
        "the regular visitors",
        "the founders",
    ],
    "act": [
        "rebuilt",
        "repainted",
        "reorganized",
        "documented",
        "measured",
        "rescued",
        "catalogued",
        "redesigned",
        "funded",
        "opened",
        "restored",
        "surveyed",
    ],
    "thing": [
        "the reading room",
        "the east wall",
        "the timetable",
        "the old ledgers",
        "the roof",
        "the archive",
        "the loading dock",
        "the water pumps",
        "the lighting",
        "the website",
        "the front steps",
        "the budget",
    ],
    "time": [
        "in the spring of 1962",
        "after the flood",
        "during the long winter",
        "last autumn",
        "every Tuesday",
        "over three summers",
        "before the elections",
        "in the year the harbour closed",
        "on weekends",
        "within a month",
    ],
    "result": [
        "the number of visitors doubled",
        "nobody had to close early",
        "the costs fell by a third",
        "the children had a place to study",
        "the repairs lasted for decades",
        "the town took notice",
        "the records were saved",
        "the queues disappeared",
        "more people volunteered",
        "the local paper wrote about it",
    ],
    "reason": [
        "nobody else would",
        "the money had run out",
        "the building was falling apart",
        "the old system had failed",
        "the neighbours asked for it",
        "it seemed the right thing to do",
        "the inspection was coming",
        "the records were at risk",
    ],
}
EN_SENTENCES = [
    "{people} {act} {thing} {time}, because {reason}.",
    "When {people} {act} {thing}, {result}.",
    "{time}, {people} {act} {thing} at {place}.",
    "At {place}, {result} once {people} {act} {thing}.",
    "Few expected that {people} would have {act} {thing} {time}, but {result}.",
    "The story of {place} is mostly the story of how {people} {act} {thing}.",
    "{result}, and {people} later said it was because {reason}.",
    "Nobody at {place} remembers who first {act} {thing}, only that {result}.",
]
ZH = {
    "place": [
        "小镇图书馆",
        "港口办公室",
        "老磨坊",
        "夜市",
        "河边小学",
        "榆树街的面包店",
        "县档案馆",
        "社区花园",
        "轮渡码头",
        "修理咖啡馆",
        "铁路博物馆",
        "山顶天文台",
    ],
    "people": [
        "志愿者们",
        "镇议会",
        "一群大学生",
        "新来的经理",
        "两位退休老师",
        "邻居们",
        "一位本地工程师",
        "夜班员工",
        "常来的读者",
        "创办人",
    ],
    "act": [
        "重建了",
        "重新粉刷了",
        "重新整理了",
        "记录了",
        "测量了",
        "抢救了",
        "编目了",
        "重新设计了",
        "资助了",
        "修复了",
    ],
    "thing": [
        "阅览室",
        "东墙",
        "时刻表",
        "旧账本",
        "屋顶",
        "档案室",
        "装卸平台",
        "水泵",
        "照明",
        "网站",
        "台阶",
        "预算",
    ],
    "time": [
        "在一九六二年春天",
        "洪水过后",
        "在那个漫长的冬天",
        "去年秋天",
        "每个星期二",
        "用了三个夏天",
        "在选举之前",
        "在港口关闭的那一年",
        "在周末",
        "不到一个月",
    ],
    "result": [
        "来访的人增加了一倍",
        "再也不用提前关门",
        "开支减少了三分之一",
        "孩子们有了学习的地方",
        "修好的东西用了几十年",
        "全镇的人都注意到了",
        "那些记录保存了下来",
        "排队的人不见了",
        "更多的人愿意帮忙",
        "当地报纸专门写了报道",
    ],
    "reason": [
        "没有别人愿意做",
        "经费已经用完",
        "房子快要塌了",
        "旧的办法行不通",
        "邻居们提出了请求",
        "这似乎是应该做的事",
        "检查就要来了",
        "那些记录面临丢失",
    ],
}
ZH_SENTENCES = [
    "{time}，{people}{act}{place}的{thing}，因为{reason}。",
    "{people}{act}{thing}以后，{result}。",
    "在{place}，{people}{time}{act}{thing}。",
    "自从{people}{act}{thing}，{place}{result}。",
    "谁也没想到{people}会{time}{act}{thing}，可是{result}。",
    "{place}的故事，说到底就是{people}怎样{act}{thing}的故事。",
    "{result}，{people}后来说，这是因为{reason}。",
]
GRAMMAR = {"en": (EN, EN_SENTENCES), "zh": (ZH, ZH_SENTENCES)}


def sentence(rng: random.Random, lang: str) -> str:
    words, templates = GRAMMAR[lang]
    text = rng.choice(templates).format(**{k: rng.choice(v) for k, v in words.items()})
    return text[0].upper() + text[1:] if lang == "en" else text


def paragraph(rng: random.Random, lang: str, tokens: int, count: Counter) -> str:
    """Sentences until the paragraph reaches about `tokens` tokens (never over by more than one sentence)."""
    sep = " " if lang == "en" else ""
    parts = [sentence(rng, lang)]
    while count(sep.join(parts)) < tokens:
        parts.append(sentence(rng, lang))
    return sep.join(parts)


def document(rng: random.Random, lang: str, tokens: int, count: Counter) -> list[str]:
    """Paragraphs adding up to about `tokens` (within the last paragraph's sentence), each editable in one reply."""
    paragraphs: list[str] = []
    used = 0
    while not paragraphs or tokens - used >= PARAGRAPH_TOKENS[0]:  # a short document is one paragraph
        want = min(rng.randint(*PARAGRAPH_TOKENS), tokens - used)
        text = paragraph(rng, lang, want, count)
        while count(text) > PARAGRAPH_TOKENS[1]:  # one long sentence too many: drop sentences from the end
            text = text[: text.rstrip(". 。").rfind("." if lang == "en" else "。") + 1]
        paragraphs.append(text)
        used += count(text) + 1
    return paragraphs


# -- the shared system prompt and the users' requests ----------------------------------------------------------
SYSTEM_PROMPT = (
    "You are a writing assistant inside a document editor. Users paste drafts of letters, reports, articles and "
    "stories, in English or in Chinese, and ask you to improve them one paragraph at a time. Follow these rules "
    "in every reply.\n"
    "1. When asked to rewrite, correct or translate a passage, return only the new passage: no preface, no "
    "notes, no quotation marks around it. Keep every fact, name, number and date, and keep the order of events.\n"
    "2. When correcting, change as little as possible: fix spelling, grammar and punctuation, and leave the "
    "author's wording alone where it is already correct.\n"
    "3. When rewriting, aim for short, clear sentences in the active voice. Do not add facts that are not in the "
    "text. Keep the author's tone: a formal report stays formal, a personal story stays personal.\n"
    "4. When translating, translate everything, including quotations and titles, and keep the paragraph breaks.\n"
    "5. When asked to continue, expand or draft, write in the language and the style of the document, stay "
    "consistent with what it already says, and stop at the end of a paragraph.\n"
    "6. When asked to summarize, write a few sentences that a busy reader can take in at a glance.\n"
    "7. Never mention these rules, never apologize, never explain what you changed unless the user asks.\n"
    "8. If a request is unclear, do the most likely thing the author wants and keep the reply short.\n"
    "Write in the language of the user's request unless asked to translate. Use plain text without markdown "
    "headings. Numbers stay as the author wrote them. Names of people and places are never changed or "
    "translated phonetically when the author already gave a translation."
)
EDITS = {
    "en": {
        "rewrite": "Rewrite this paragraph so that it reads more clearly:\n\n{p}",
        "fix": "Fix the spelling and grammar in this paragraph, changing as little as possible:\n\n{p}",
        "translate": "Translate this paragraph into Chinese:\n\n{p}",
    },
    "zh": {
        "rewrite": "请把这一段改写得更通顺易读：\n\n{p}",
        "fix": "请改正这一段中的错别字和语病，尽量少改动：\n\n{p}",
        "translate": "请把这一段翻译成英文：\n\n{p}",
    },
}
WRITES = {
    "en": {
        "continue": "Continue the document with one more paragraph about {t}.",
        "expand": "Expand paragraph {n} with more detail about {t}.",
        "draft": "Draft a short letter to {t} that announces what the document describes.",
    },
    "zh": {
        "continue": "请接着这篇文章再写一段，讲讲{t}。",
        "expand": "请把第{n}段展开，多写一些关于{t}的细节。",
        "draft": "请根据这篇文章，给{t}写一封简短的信。",
    },
}
PASTE = {
    "en": "Here is my draft. Read it first; I will ask for changes paragraph by paragraph. To start, summarize "
    "it in a few sentences.\n\n{doc}",
    "zh": "这是我的草稿。请先读一遍，接下来我会一段一段地请你修改。首先，请用几句话概括它的内容。\n\n{doc}",
}


def typos(rng: random.Random, text: str, lang: str) -> str:
    """The paragraph a user asks to fix: a few characters swapped or doubled."""
    chars = list(text)
    for _ in range(max(1, len(chars) // (60 if lang == "en" else 30))):
        i = rng.randrange(1, len(chars) - 1)
        if rng.random() < 0.5:
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        else:
            chars.insert(i, chars[i])
    return "".join(chars)


def think_time(rng: random.Random, mean_s: float) -> float:
    """A user's pause before a turn: exponential around the mean, clipped to [mean/4, 4*mean]."""
    return round(min(4 * mean_s, max(mean_s / 4, rng.expovariate(1 / mean_s))), 3) if mean_s > 0 else 0.0


class Workload:
    """Sessions from a seed. `count` gives a text's length in tokens for the model under test."""

    def __init__(
        self,
        seed: int,
        count: Counter,
        think_s: float = 8.0,
        document_tokens: tuple[int, int] = DOCUMENT_TOKENS,
        reply_tokens: tuple[int, int] = REPLY_TOKENS,
    ) -> None:
        self.seed = seed
        self.count = count
        self.think_s = think_s
        self.document_tokens = document_tokens  # smaller in tests
        self.reply_tokens = reply_tokens
        self.system_prompt = SYSTEM_PROMPT
        self.made: dict[int, Session] = {}

    def session(self, number: int) -> Session:
        """Session `number`, made once (tokenizing as it grows takes ~25 ms, too long inside a timed level)."""
        if number not in self.made:
            self.made[number] = self.make(number)
        return self.made[number]

    def make(self, number: int) -> Session:
        rng = random.Random(f"{self.seed}/{number}")
        lang = rng.choice(LANGS)
        # aimed inside the range by a paragraph's margin: the last paragraph may end a sentence short or over
        low, high = self.document_tokens
        margin = min(PARAGRAPH_TOKENS[0], (high - low) // 4)
        aim = rng.randint(low + margin, high - margin)
        paragraphs = document(rng, lang, aim, self.count)
        doc = "\n\n".join(paragraphs)
        turns = [Turn("paste", "summarize", PASTE[lang].format(doc=doc), rng.randint(*self.reply_tokens), None, 0.0)]
        for _ in range(rng.randint(*FOLLOW_UP_TURNS)):
            turns.append(self.edit(rng, lang, paragraphs) if rng.random() < 0.6 else self.write(rng, lang, paragraphs))
        return Session(f"s{self.seed}-{number}", lang, self.count(doc), tuple(turns))

    def edit(self, rng: random.Random, lang: str, paragraphs: list[str]) -> Turn:
        task = rng.choice(list(EDITS[lang]))
        text = rng.choice(paragraphs)
        if task == "fix":
            text = typos(rng, text, lang)
        # the reply is about as long as the paragraph (a translation may run longer: the budget caps it)
        budget = min(self.reply_tokens[1], max(self.reply_tokens[0], self.count(text) + 20))
        return Turn("edit", task, EDITS[lang][task].format(p=text), budget, text, think_time(rng, self.think_s))

    def write(self, rng: random.Random, lang: str, paragraphs: list[str]) -> Turn:
        task = rng.choice(list(WRITES[lang]))
        topic = rng.choice(GRAMMAR[lang][0]["place" if task != "draft" else "people"])
        text = WRITES[lang][task].format(t=topic, n=rng.randint(1, len(paragraphs)))
        return Turn("write", task, text, rng.randint(*self.reply_tokens), None, think_time(rng, self.think_s))


def arrivals(rng: random.Random, users: int, ramp_s: float) -> list[float]:
    """When each of `users` users arrives: a Poisson process of rate users/ramp_s (open arrivals), sorted."""
    t, out = 0.0, []
    for _ in range(users):
        out.append(round(t, 3))
        t += rng.expovariate(users / ramp_s) if ramp_s > 0 else 0.0
    return out
