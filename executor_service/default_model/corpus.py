"""The default model's training text: short stories, plain facts and question-answer dialogues.

Generated from hand-written templates by a seeded random generator, so the same seed always gives the
same text (`python -m executor_service.default_model corpus` writes it to data/generated_corpus.txt).
Every sentence is original; nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

USER = "User:"
ASSISTANT = "Assistant:"

NAMES = ("Lily", "Tom", "Mara", "Ben", "Sara", "Leo", "Anna", "Max", "Nora", "Sam", "Emma", "Jack", "Mia", "Finn",
         "Rosa", "Theo", "Ella", "Oscar", "Ivy", "Hugo", "Lucy", "Noah", "Zoe", "Eli", "Ruth", "Paul", "Alma", "Otto")
PEOPLE = ("a little girl", "a little boy", "an old fisherman", "a young baker", "a curious student", "a kind farmer",
          "a quiet painter", "a brave sailor", "a busy doctor", "a clever carpenter", "a shy musician",
          "a careful librarian", "a cheerful gardener", "a tired teacher", "a young nurse", "an old shepherd")
ANIMALS = ("a small dog", "a gray cat", "a brown rabbit", "a clever fox", "a little bird", "an old horse",
           "a young goat", "a friendly duck", "a slow turtle", "a fluffy sheep", "a busy squirrel", "a tiny mouse")
PLACES = ("a small village by the sea", "a busy town with narrow streets", "a quiet farm near the hills",
          "a big city full of lights", "a green valley with a river", "an old house at the edge of the forest",
          "a cold island in the north", "a warm village in the south", "a little cottage in the mountains",
          "a harbor town with many boats")
OBJECTS = ("a red ball", "a blue kite", "a shiny key", "an old map", "a wooden box", "a yellow hat", "a silver coin",
           "a small boat", "a warm blanket", "a green bottle", "a broken clock", "a paper lantern", "a big book",
           "a glass jar", "a pair of boots", "a basket of apples", "a new bicycle", "a music box")
FEELINGS = ("happy", "sad", "scared", "excited", "proud", "worried", "surprised", "tired", "curious", "calm")
WEATHER = ("The sun was bright and warm.", "The rain fell softly on the roofs.", "A cold wind blew from the sea.",
           "Snow covered the fields and the trees.", "The sky was gray and heavy with clouds.",
           "It was a clear morning, and the air smelled of grass.", "Fog lay over the water like a blanket.",
           "The evening was quiet, and the first stars came out.")
FRIENDS = ("mother", "father", "grandmother", "grandfather", "best friend", "little brother", "older sister",
           "neighbor", "teacher", "uncle", "aunt")
ACTIVITIES = ("read a book under the tree", "bake bread with a lot of butter", "walk along the river",
              "draw pictures of the clouds", "plant seeds in the garden", "sing songs by the fire",
              "build a small house out of sticks", "fly a kite on the hill", "swim in the cold lake",
              "count the boats in the harbor", "play music in the square", "look at the stars at night",
              "pick berries in the forest", "fix old clocks", "feed the ducks at the pond")
TIMES = ("One morning", "One day", "Early one spring", "Late one autumn evening", "On a cold winter day",
         "One summer afternoon", "Last week", "A long time ago", "Every Sunday", "On a rainy day")


@dataclass(slots=True, frozen=True)
class Fact:
    question: str
    answer: str


FACTS = (
    Fact("Why is the sky blue?", "Sunlight has every color in it, but blue light scatters more in the air than red "
         "light, so blue reaches our eyes from every direction."),
    Fact("What is water made of?", "Water is made of hydrogen and oxygen. Each small piece of water has two hydrogen "
         "atoms and one oxygen atom."),
    Fact("At what temperature does water boil?", "At sea level, water boils at one hundred degrees Celsius and "
         "freezes at zero degrees."),
    Fact("Why do leaves change color in autumn?", "In autumn the days get shorter, and trees stop making the green "
         "pigment in their leaves, so the yellow and red colors underneath can be seen."),
    Fact("How many legs does a spider have?", "A spider has eight legs. Insects, like ants and bees, have six."),
    Fact("What do bees make?", "Bees make honey from the nectar of flowers, and they store it in wax cells in "
         "their hive."),
    Fact("Why does the moon change shape?", "The moon does not really change shape. As it goes around the earth, we "
         "see different parts of its sunny side."),
    Fact("What is the largest planet?", "Jupiter is the largest planet in our solar system. It is made mostly of gas "
         "and has many moons."),
    Fact("How do plants eat?", "Plants make their own food from sunlight, water and air. This is called "
         "photosynthesis, and it happens in their green leaves."),
    Fact("Why do we need sleep?", "Sleep lets the body rest and the brain sort out what it learned during the day. "
         "Most adults need about eight hours each night."),
    Fact("What is a computer?", "A computer is a machine that follows instructions. It stores numbers in memory and "
         "changes them very quickly, one small step at a time."),
    Fact("What is a language model?", "A language model is a program that reads text as tokens and learns to guess "
         "the next token from the ones before it."),
    Fact("How does bread rise?", "Yeast in the dough eats sugar and makes small bubbles of gas. The bubbles get "
         "trapped in the dough, and the bread rises."),
    Fact("Why is the sea salty?", "Rivers carry tiny amounts of salt from rocks into the sea. The water evaporates, "
         "but the salt stays behind, so the sea slowly became salty."),
    Fact("What makes a rainbow?", "A rainbow appears when sunlight passes through drops of rain. Each drop bends the "
         "light and splits it into red, orange, yellow, green, blue and violet."),
    Fact("How fast does light travel?", "Light travels about three hundred thousand kilometers every second. It "
         "takes about eight minutes to reach us from the sun."),
    Fact("Why do cats purr?", "Cats purr when they are calm and happy, and sometimes when they are hurt. The sound "
         "comes from muscles in their throat."),
    Fact("What is the capital of France?", "The capital of France is Paris, a city on the river Seine."),
    Fact("How many days are in a year?", "A year has three hundred and sixty five days, and a leap year has one "
         "more day."),
    Fact("What do cows eat?", "Cows eat grass and hay. They chew their food twice, which helps them digest tough "
         "plants."),
    Fact("Why do birds fly south?", "Many birds fly south in autumn because food becomes hard to find in the cold. "
         "They come back in spring when the weather is warm again."),
    Fact("What is the sun?", "The sun is a star. It is a huge ball of hot gas that gives the earth light and heat."),
    Fact("How do fish breathe?", "Fish breathe with gills. Water flows over the gills, and they take oxygen from "
         "the water."),
    Fact("What is snow?", "Snow is frozen water. Tiny ice crystals form in cold clouds and stick together as they "
         "fall."),
    Fact("Why do we have seasons?", "The earth is tilted. As it goes around the sun, each half of the earth leans "
         "toward the sun for part of the year, and that part has summer."),
    Fact("What is a volcano?", "A volcano is an opening in the ground where hot melted rock, ash and gas come out "
         "from deep inside the earth."),
    Fact("How do you make tea?", "Boil some water, pour it over the tea leaves, and wait three or four minutes. "
         "Then take the leaves out and drink it while it is warm."),
    Fact("What is a scheduler?", "A scheduler decides which work runs next. In an inference server it picks which "
         "requests get to use the model at each step."),
    Fact("What is the tallest animal?", "The giraffe is the tallest animal. Its long neck helps it eat leaves from "
         "the tops of trees."),
    Fact("How do ships float?", "A ship floats because it pushes away a lot of water. The water pushes back up, and "
         "that push is strong enough to hold the ship."),
    Fact("What is an island?", "An island is a piece of land with water all around it."),
    Fact("Why do we see lightning before thunder?", "Light travels much faster than sound, so we see the flash "
         "first and hear the thunder a few seconds later."),
    Fact("What is a good way to learn?", "Practice a little every day, ask questions, and explain what you learned "
         "to someone else."),
    Fact("What do owls eat?", "Owls eat mice, insects and small birds. They hunt at night and can see well in the "
         "dark."),
    Fact("Where do penguins live?", "Most penguins live in the southern half of the world, near the cold sea. They "
         "cannot fly, but they swim very well."),
    Fact("Why is exercise good for you?", "Exercise makes the heart and muscles stronger, helps you sleep, and "
         "often makes you feel happier."),
)
GREETINGS = (
    Fact("Hello!", "Hello! How can I help you today?"),
    Fact("Hi, who are you?", "I am a small language model. I was trained on short stories and simple facts, so "
         "I can answer easy questions."),
    Fact("Thank you.", "You are welcome. Have a nice day!"),
    Fact("Tell me a story.", "Once upon a time, there was a little cat who lived in a quiet village. Every day she "
         "sat by the window and watched the birds. One day she made a friend, and she was never lonely again."),
    Fact("Good morning.", "Good morning! I hope you slept well."),
    Fact("How are you?", "I am fine, thank you. What would you like to know?"),
)


def generate_corpus(seed: int = 0, target_chars: int = 360_000) -> str:
    """Stories, fact paragraphs and dialogues, separated by blank lines, until target_chars is reached."""
    rng = random.Random(seed)
    makers = (make_story, make_story, make_story, make_animal_story, make_fact_paragraph, make_dialogue)
    parts: list[str] = []
    size = 0
    while size < target_chars:
        text = rng.choice(makers)(rng)
        parts.append(text)
        size += len(text) + 2
    return "\n\n".join(parts) + "\n"


def make_story(rng: random.Random) -> str:
    name, person, place, obj = rng.choice(NAMES), rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(OBJECTS)
    friend, activity, feeling = rng.choice(FRIENDS), rng.choice(ACTIVITIES), rng.choice(FEELINGS)
    pronoun = pronoun_for(person, rng)
    sentences = [
        f"Once upon a time, there was {person} named {name} who lived in {place}.",
        f"{name} loved to {activity}.",
        rng.choice(WEATHER),
        f"{rng.choice(TIMES)}, {name} found {obj} near the {rng.choice(SPOTS)}.",
        f"{pronoun.capitalize()} felt {feeling} and wondered who it belonged to.",
        f"{name} asked {pronoun_poss(pronoun)} {friend}, \"{rng.choice(QUESTIONS)}\"",
        f"The {friend} smiled and said, \"{rng.choice(ADVICE)}\"",
        f"So {name} {rng.choice(ACTIONS)}.",
        rng.choice(ENDINGS).format(name=name, obj=obj.split(' ', 1)[1], pronoun=pronoun.capitalize()),
    ]
    if rng.random() < 0.5:
        sentences.insert(2, f"{pronoun.capitalize()} had {rng.choice(ANIMALS)} that followed {pronoun_obj(pronoun)} "
                         f"everywhere.")
    return " ".join(sentences)


SPOTS = ("door", "river", "old tree", "road", "well")
QUESTIONS = ("What should I do with it?", "Do you know whose this is?", "Can I keep it?", "Where did this come from?",
             "Will you help me?", "Is it magic?")
ADVICE = ("If something is not yours, try to find its owner.", "Be patient, and the answer will come.",
          "Kindness is never wasted.", "Let us look for the owner together.", "Ask around the village tomorrow.",
          "Some things are worth sharing.", "Take good care of it for now.")
ACTIONS = ("walked from house to house and asked every neighbor", "wrote a little note and put it in the window",
           "waited by the road all afternoon", "went to the market and asked the people there",
           "carried it home and kept it safe", "told the story to everyone at school")
ENDINGS = (
    "At last the owner came, and {name} was very happy to give the {obj} back. From that day on, they were good "
    "friends.",
    "Nobody came for the {obj}, so {name} kept it and shared it with the other children. Everyone was happy.",
    "In the end, {name} learned that helping others feels better than keeping things. {pronoun} smiled all the "
    "way home.",
    "That night, {name} fell asleep with a happy heart, and the {obj} sat on the shelf by the window.",
    "The next morning the sun came out, and {name} knew that everything would be all right.",
)


def make_animal_story(rng: random.Random) -> str:
    animal, other, place = rng.choice(ANIMALS), rng.choice(ANIMALS), rng.choice(PLACES)
    food = rng.choice(("berries", "seeds", "carrots", "bread crumbs", "apples", "nuts", "fresh grass"))
    head = animal.split(" ")[-1]
    other_head = other.split(" ")[-1]
    sentences = [
        f"In {place} there lived {animal}.",
        f"Every day the {head} looked for {food} to eat.",
        rng.choice(WEATHER),
        f"One day the {head} met {other}.",
        f"\"Hello,\" said the {head}. \"Do you want to be my friend?\"",
        f"The {other_head} was {rng.choice(FEELINGS)} at first, but then it said yes.",
        f"Together they {rng.choice(TOGETHER)}.",
        rng.choice(("The two friends played until it was dark.", "They learned that friends make every day better.",
                    "After that, the two animals were never lonely again.",
                    "And every evening they met again under the old tree.")),
    ]
    return " ".join(sentences)


TOGETHER = ("ran across the fields", "swam in the pond", "found a warm place to sleep", "shared their food",
            "watched the sun go down", "explored the forest")


def make_fact_paragraph(rng: random.Random) -> str:
    facts = rng.sample(FACTS, k=rng.randint(2, 4))
    return " ".join(fact.answer for fact in facts)


def make_dialogue(rng: random.Random) -> str:
    pool = FACTS if rng.random() < 0.8 else GREETINGS
    turns = rng.sample(pool, k=rng.randint(1, 2))
    return "\n".join(f"{USER} {fact.question}\n{ASSISTANT} {fact.answer}" for fact in turns)


def pronoun_for(person: str, rng: random.Random) -> str:
    if "girl" in person:
        return "she"
    if "boy" in person or "fisherman" in person:
        return "he"
    return rng.choice(("he", "she"))


def pronoun_poss(pronoun: str) -> str:
    return "her" if pronoun == "she" else "his"


def pronoun_obj(pronoun: str) -> str:
    return "her" if pronoun == "she" else "him"
