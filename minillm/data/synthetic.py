"""A children's-story generator: the corpus of last resort, when TinyStories cannot be had.

TinyStories (Eldan and Li, 2023) showed that a model of a few million parameters learns
fluent English if its corpus uses a small child's vocabulary. Offline we cannot download it,
so we write stories of the same kind: a hero, a friend, a grown-up, a place and a thing; one
of ten plots (a lost toy, a kite in a tree, learning to share, a fear faced...); dialogue;
feelings that follow from events; and an ending. Every choice comes from one seeded
``random.Random``, so story ``i`` of seed ``s`` is always the same text.

The parts multiply to far more than millions of distinct stories (names x kinds x places x
things x plots x phrasings), so a model must learn grammar and consistency (the girl who lost
her red ball is the one who finds it), not memorise a few texts.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Iterator

GIRLS = "Lily Mia Emma Sara Zoe Anna Lucy Ella Ruby Rosa Maya Nora Amy Kim Jane Sue Tia Ivy Lena Ada Hana Leah May Nina Olivia Grace Chloe Daisy Molly Bella".split()
BOYS = "Tom Ben Max Sam Leo Jack Tim Finn Noah Eli Jake Owen Luke Omar Ravi Theo Hugo Kai Milo Oscar Liam Dan Ned Joe Paul Ryan Adam Luca Billy Toby".split()
ANIMALS = [  # kind, sound-free description words
    ("dog", "furry"), ("cat", "soft"), ("bunny", "fluffy"), ("bear", "big"), ("duck", "yellow"),
    ("fox", "quick"), ("mouse", "tiny"), ("frog", "green"), ("owl", "wise"), ("pig", "pink"),
    ("turtle", "slow"), ("squirrel", "busy"), ("lion", "brave"), ("puppy", "playful"),
    ("kitten", "sleepy"), ("bird", "little"), ("elephant", "gentle"), ("monkey", "funny"),
    ("dragon", "small"), ("robot", "shiny"), ("hedgehog", "prickly"), ("goat", "hungry"),
]
TRAITS = "kind curious happy shy brave silly clever gentle cheerful careful friendly quiet busy playful helpful".split()
GROWNUPS = ["Mom", "Dad", "Grandma", "Grandpa", "the teacher", "Aunt May", "Uncle Bob"]
PLACES = [  # place, the preposition for being there, a spot where a lost thing could be, a sight
    ("the park", "in", "under a bench", "tall trees"), ("the forest", "in", "behind a big rock", "pretty flowers"),
    ("the beach", "at", "under the warm sand", "blue waves"), ("the garden", "in", "under a big leaf", "red roses"),
    ("the farm", "on", "in the hay", "cows and sheep"), ("the pond", "by", "by the tall reeds", "little fish"),
    ("the hill", "on", "behind a bush", "white clouds"), ("the school yard", "in", "near the slide", "other kids"),
    ("the meadow", "in", "in the long grass", "yellow butterflies"), ("the zoo", "at", "by the gate", "a tall giraffe"),
    ("the lake", "by", "next to a boat", "ducks swimming"), ("the town square", "in", "under a cart", "a big fountain"),
    ("the backyard", "in", "by the fence", "a swing"), ("the library", "at", "under a table", "many books"),
    ("the playground", "at", "inside the sandbox", "a red slide"), ("the river", "by", "by a log", "shiny stones"),
]
THINGS = [  # thing, can it fly or float up (for the stuck-in-a-tree plot)
    ("ball", False), ("kite", True), ("teddy bear", False), ("toy car", False), ("balloon", True),
    ("hat", True), ("book", False), ("doll", False), ("toy boat", False), ("drum", False),
    ("scarf", True), ("shell", False), ("crayon box", False), ("paper plane", True), ("cup", False),
    ("blanket", False), ("flower crown", True), ("puzzle", False), ("toy train", False), ("ribbon", True),
]
COLORS = "red blue green yellow pink purple orange white brown shiny little big striped spotted".split()
TIMES = [
    "Once upon a time", "One sunny day", "One morning", "One windy afternoon", "Long ago",
    "One cold winter day", "One warm summer day", "On a rainy day", "One evening", "One spring morning",
]
LESSONS = {
    "lost": ["looking carefully is better than crying", "friends help you find what you lose", "it is good to ask for help"],
    "stuck": ["working together makes hard things easy", "a good friend always helps", "it is okay to ask a grown-up for help"],
    "share": ["sharing makes playing more fun", "it feels good to share", "toys are better with a friend"],
    "fear": ["being brave does not mean you are not scared", "new things can be fun", "you can be brave a little at a time"],
    "broken": ["broken things can often be fixed", "it is okay to make mistakes", "love can fix many things"],
    "new_friend": ["saying hello is the first step to a new friend", "everyone can be a friend", "being kind is easy"],
    "discover": ["the world is full of surprises", "it is fun to be curious", "you should always look closely"],
    "help": ["helping others makes your heart happy", "even small friends can help", "kindness always comes back"],
    "race": ["friends matter more than winning", "helping a friend is the best way to win", "it is fun to play fair"],
    "make": ["mistakes can be funny", "if at first you do not win, try again", "doing things together is the best"],
}


@dataclass(frozen=True)
class Character:
    """Someone in a story, with the pronouns that keep every sentence about them consistent."""

    name: str
    kind: str  # girl, boy, dog, ...
    trait: str
    she: str  # subject pronoun: she / he / it
    her: str  # object pronoun
    hers: str  # possessive adjective: her / his / its

    @property
    def called(self) -> str:
        """How the story names them: 'Amy', or 'Leah the dog'."""
        return self.name if self.kind in ("girl", "boy") else f"{self.name} the {self.kind}"

    def intro(self, rng: random.Random) -> str:
        """The story's first sentence."""
        when = rng.choice(TIMES)
        return rng.choice([
            f"{when}, there was {a(self.trait)} {self.kind} named {self.name}.",
            f"{when}, there lived {a(self.trait)} little {self.kind} called {self.name}.",
            f"{self.name} was {a(self.trait)} {self.kind} who lived in a little house by {rng.choice(['the woods', 'the sea', 'a big hill', 'a quiet road'])}.",
        ])


def a(word: str) -> str:
    """The indefinite article a reader expects: 'a kite', 'an owl'."""
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def make_character(rng: random.Random, avoid: str = "") -> Character:
    """A child or an animal; animals are 'he' or 'she' as children's books make them."""
    trait = rng.choice(TRAITS)
    roll = rng.random()
    if roll < 0.35:
        name, kind, pron = rng.choice([n for n in GIRLS if n != avoid]), "girl", "she"
    elif roll < 0.7:
        name, kind, pron = rng.choice([n for n in BOYS if n != avoid]), "boy", "he"
    else:
        kind, _ = rng.choice(ANIMALS)
        pron = rng.choice(["she", "he"])
        name = rng.choice([n for n in (GIRLS if pron == "she" else BOYS) if n != avoid])
    if pron == "she":
        return Character(name, kind, trait, "she", "her", "her")
    return Character(name, kind, trait, "he", "him", "his")


@dataclass(frozen=True)
class Cast:
    """Everything one story is about, chosen before any sentence is written."""

    hero: Character
    friend: Character
    grownup: str
    place: str
    at: str  # 'in the park', 'on the farm'
    spot: str
    sight: str
    thing: str
    flies: bool


def say(rng: random.Random, who: Character | str, words: str) -> str:
    """A line of dialogue, punctuated as books do: '"Let us go," said Amy.'"""
    name = who.name if isinstance(who, Character) else who
    if words.endswith("?"):
        verb = "asked"
    else:
        verb = rng.choice(["said", "said", "cried", "whispered", "shouted"] if words.endswith("!") else ["said", "said", "whispered", "replied"])
        words = words[:-1] + "," if words.endswith(".") else words
    return f'"{words}" {verb} {name}.'


def plot_lost(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    return [
        f"{cap(h.hers)} favorite thing in the whole world was {h.hers} {c.thing}. {cap(h.she)} took it everywhere.",
        f"One day, {h.name} went to {c.place} to play. {cap(h.she)} saw {c.sight} and ran to look. When {h.she} came back, the {c.thing} was gone!",
        f"{h.name} felt very {r.choice(['sad', 'worried', 'upset'])}. {cap(h.she)} began to cry.",
        f"Just then, {h.hers} friend {f.called} came by. " + say(r, f, f"Why are you crying, {h.name}?"),
        say(r, h, f"I lost my {c.thing}. I looked everywhere!"),
        say(r, f, r.choice(["Do not worry. I will help you look.", "Let us look together. Two can see more than one."])),
        f"They looked by the trees. They looked by the path. At last {f.name} looked {c.spot}, and there it was!",
        f"{h.name} hugged {h.hers} {c.thing} and then hugged {f.name}. " + say(r, h, f"Thank you, {f.name}! You are the best friend."),
    ]


def plot_stuck(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    up = "the wind blew it high into a tree" if c.flies else f"{h.she} threw it so high that it got stuck in a tree"
    helper = r.choice([f"{f.name} had an idea. {cap(f.she)} climbed on a big rock and reached up", f"{f.name} ran to get {c.grownup}, who brought a long ladder and climbed up"])
    return [
        f"{h.name} had {a(r.choice(COLORS))} {c.thing}. {cap(h.she)} loved to play with it {c.at}.",
        f"One day, {up}. The {c.thing} was stuck!",
        f"{h.name} jumped and jumped, but {h.she} was too small. {cap(h.she)} felt {r.choice(['sad', 'angry', 'tired'])}.",
        say(r, h, "I can not reach it. What can I do?"),
        f"{h.hers.capitalize()} friend {f.name} saw {h.her}. " + say(r, f, "I will help you!"),
        f"{helper}. Slowly, slowly, the {c.thing} came down.",
        f"{h.name} was so happy. {cap(h.she)} and {f.name} played with the {c.thing} until the sun went down.",
    ]


def plot_share(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    return [
        f"{h.name} got a new {c.thing} from {c.grownup}. It was {r.choice(COLORS)} and {h.name} loved it very much.",
        f"{cap(h.she)} took it to {c.place}. There {h.she} met {f.called}.",
        say(r, f, f"That is a nice {c.thing}. Can I play with it too?"),
        say(r, h, "No! It is mine!") + f" {h.name} held the {c.thing} close.",
        f"{f.name} looked sad and walked away. {h.name} played alone, but it was not fun. {cap(h.she)} felt bad inside.",
        f"{cap(h.she)} remembered what {c.grownup} always said: a toy is more fun with a friend.",
        f"{h.name} ran to {f.name}. " + say(r, h, f"I am sorry, {f.name}. Do you want to play with my {c.thing}?"),
        f"{f.name} smiled a big smile. They took turns and laughed all day.",
    ]


def plot_fear(c: Cast, r: random.Random) -> list[str]:
    h = c.hero
    fear, brave = r.choice([
        ("the dark", f"{h.she} turned off the light and saw the moon shining softly through the window"),
        ("thunder", f"{h.she} counted the seconds between the flash and the boom, and the storm moved far away"),
        ("the deep water", f"{h.she} put one foot in, then two, and soon {h.she} was splashing and kicking"),
        ("the big slide", f"{h.she} climbed to the top, held on tight, and whoosh, down {h.she} went"),
        ("the big dog next door", f"{h.she} held out {h.hers} hand, and the dog licked it and wagged its tail"),
    ])
    return [
        f"{h.name} was afraid of {fear}. Every time {h.she} thought about it, {h.hers} tummy felt funny.",
        f"One day, {h.name} told {c.grownup}. " + say(r, h, f"I am scared of {fear}."),
        f"{cap(c.grownup)} sat down next to {h.her}. " + say(r, c.grownup, r.choice(["Everyone is scared sometimes. Being brave means you try anyway.", "I will be right here with you. Let us try together."])),
        f"{h.name} took a deep breath. Then {brave}.",
        say(r, h, r.choice(["I did it!", "That was not so scary!", "Look at me, I am brave!"])) + f" {h.name} felt very proud.",
        f"{cap(c.grownup)} gave {h.her} a big hug, and {h.name} was not afraid of {fear} anymore.",
    ]


def plot_broken(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    fix = r.choice(["some glue", "a roll of tape", "a needle and thread", "a few small nails"])
    return [
        f"{h.name} and {f.name} were playing with {h.hers} {c.thing} {c.at}.",
        f"{f.name} pulled too hard, and snap! The {c.thing} broke into two pieces.",
        f"{h.name} was {r.choice(['very sad', 'angry', 'upset'])}. " + say(r, h, f"You broke my {c.thing}!"),
        say(r, f, "I am so sorry. I did not mean to.") + f" {f.name} looked like {f.she} would cry too.",
        f"They took the pieces home to {c.grownup}. {cap(c.grownup)} found {fix} and fixed the {c.thing}.",
        f"It was not perfect, but it worked. " + say(r, h, f"It is okay, {f.name}. I forgive you."),
        "The two friends played again, and this time they were very gentle.",
    ]


def plot_new_friend(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    game = r.choice(["tag", "hide and seek", "a game with the " + c.thing, "catch", "pretend pirates"])
    return [
        f"{h.name} went to {c.place} for the first time. {cap(h.she)} did not know anyone there, and {h.she} felt {r.choice(['shy', 'lonely', 'a little scared'])}.",
        f"Then {h.she} saw {f.name}, {a(f.trait)} {f.kind}, sitting all alone.",
        f"{h.name} wanted to say hello, but {h.hers} voice was very small. At last {h.she} walked over.",
        say(r, h, f"Hello. My name is {h.name}. Do you want to play {game}?"),
        say(r, f, "Yes, please! I was hoping someone would ask.") ,
        f"They played {game} until they were tired. Then they sat and looked at {c.sight}.",
        f"When it was time to go home, {f.name} said, \"Will you come back tomorrow?\" {h.name} nodded. {cap(h.she)} had a new friend.",
    ]


def plot_discover(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    find, surprise = r.choice([
        ("a small blue egg", "a tiny bird came out and said, \"Peep!\""),
        ("an old map", "they found a box full of shiny buttons."),
        ("a little door in a tree", "inside lived a family of mice having tea."),
        ("a trail of footprints", "they led to a baby deer sleeping in the grass."),
        ("a glowing stone", "it lit up the path like a little lamp."),
    ])
    return [
        f"{h.name} loved to explore. One day {c.at}, {h.she} found {find} {c.spot}.",
        say(r, h, "What is this?") + f" {h.name} called {h.hers} friend {f.name} to come and see.",
        f"{f.name} looked at it with big eyes. " + say(r, f, "Let us find out!"),
        f"They waited and watched. They looked and listened. Then, all of a sudden, {surprise}",
        f"{h.name} and {f.name} laughed with joy. It was the best surprise of the whole {r.choice(['day', 'week', 'summer'])}.",
    ]


def plot_help(c: Cast, r: random.Random) -> list[str]:
    h = c.hero
    who, need, done = r.choice([
        ("a little bird with a hurt wing", "could not fly", "Soon the bird's wing was better, and it flew in a circle over their heads"),
        ("an old man with heavy bags", "could not carry them up the hill", "The old man smiled and gave them each a sweet red apple"),
        ("a lost puppy", "could not find its home", "They read the name on its collar and walked it home to a very happy boy"),
        ("a tiny ant with a big crumb", "could not get it over a stick", "The ant carried its crumb home, and it seemed to wave goodbye"),
    ])
    return [
        f"{h.name} was walking to {c.place} with {c.grownup}. On the way, {h.she} saw {who}.",
        f"It {need}. {h.name} stopped. " + say(r, h, f"{cap(c.grownup)}, we have to help!"),
        f"{cap(c.grownup)} smiled. " + say(r, c.grownup, "You have a kind heart. Let us help together."),
        f"{h.name} was careful and gentle. {done}.",
        f"{h.name} felt warm and happy inside. Helping felt even better than playing.",
    ]


def plot_race(c: Cast, r: random.Random) -> list[str]:
    h, f = c.hero, c.friend
    return [
        f"{h.name} and {f.name} loved to race. Today they would race across {c.place}.",
        say(r, f, "Ready, set, go!") + " They ran as fast as they could.",
        f"{h.name} was in front. {cap(h.she)} was going to win! But then {h.she} heard a cry. {f.name} had fallen down.",
        f"{h.name} stopped. {cap(h.she)} ran back and helped {f.name} stand up. " + say(r, h, "Are you okay?"),
        say(r, f, "My knee hurts, but I am okay.") + " They walked to the end together, hand in hand.",
        f"{cap(c.grownup)} clapped. " + say(r, c.grownup, f"{h.name}, you did not win the race, but you did something better."),
    ]


def plot_make(c: Cast, r: random.Random) -> list[str]:
    h = c.hero
    thing, oops = r.choice([
        ("cake", "too much flour went everywhere, and the kitchen was all white"),
        ("sandcastle", "a big wave came and washed it away"),
        ("tower of blocks", "the tower wobbled and fell down with a crash"),
        ("picture for Grandma", "the paint spilled all over the paper"),
        ("bird house", "one side was longer than the other"),
    ])
    return [
        f"{h.name} and {c.grownup} wanted to make {a(thing)}. {h.name} was very excited.",
        f"They worked and worked. But then {oops}.",
        f"{h.name} looked at {c.grownup}. {cap(c.grownup)} looked at {h.name}. Then they both started to laugh.",
        say(r, c.grownup, "Let us try again.") + " And they did.",
        f"The second time was even better. {h.name} was proud of the {thing}, and {h.she} showed it to everyone.",
    ]


PLOTS: dict[str, Callable[[Cast, random.Random], list[str]]] = {
    "lost": plot_lost, "stuck": plot_stuck, "share": plot_share, "fear": plot_fear,
    "broken": plot_broken, "new_friend": plot_new_friend, "discover": plot_discover,
    "help": plot_help, "race": plot_race, "make": plot_make,
}


def ending(c: Cast, plot: str, r: random.Random) -> str:
    lesson = r.choice(LESSONS[plot])
    h = c.hero
    return r.choice([
        f"From that day on, {h.name} knew that {lesson}.",
        f"That night, {h.name} went to sleep with a big smile. {cap(h.she)} had learned that {lesson}.",
        f"And {h.name} never forgot that {lesson}.",
        f"The end.",
        f"It was a very good day.",
    ])


def story(rng: random.Random) -> str:
    """One story, every choice drawn from ``rng``."""
    hero = make_character(rng)
    friend = make_character(rng, avoid=hero.name)
    grownup = rng.choice(GROWNUPS)
    place, prep, spot, sight = rng.choice(PLACES)
    thing, flies = rng.choice(THINGS)
    cast = Cast(hero, friend, grownup, place, f"{prep} {place}", spot, sight, thing, flies)
    plot = rng.choice(list(PLOTS))
    sentences = [hero.intro(rng), *PLOTS[plot](cast, rng), ending(cast, plot, rng)]
    # Group sentences into short paragraphs, as children's books print them.
    paragraphs, i = [], 0
    while i < len(sentences):
        n = rng.choice([1, 2, 2, 3])
        paragraphs.append(" ".join(sentences[i:i + n]))
        i += n
    return "\n\n".join(paragraphs)


_NAME = re.compile(r"\b(" + "|".join(GIRLS + BOYS) + r")\b")


def story_names(text: str) -> list[str]:
    """Every mention of a child's or an animal's name in ``text``, in order (names from
    :data:`GIRLS` and :data:`BOYS`; grown-ups are not counted, so "Aunt May" is not May).
    A story of this generator names its hero first and a friend after."""
    for grownup in GROWNUPS:
        text = text.replace(grownup, "")
    return _NAME.findall(text)


def generate_stories(n: int, seed: int = 0) -> Iterator[str]:
    """``n`` stories; story ``i`` depends only on ``(seed, i)``, so any prefix is reproducible."""
    for i in range(n):
        yield story(random.Random(f"minillm-synthetic:{seed}:{i}"))
