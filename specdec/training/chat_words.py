"""A third chat family for the head trainer's prompts (training/prompts.py): wider everyday requests.

The first two chat families (task x topic, and prompt_words.py's everyday forms) hold ~3,200 prompts and
are used up near prompt 4,500 of the set; past that the set grew with coding requests only, and the
shipped SmolLM2 head's acceptance on chat answers (what users of a chat model ask) grew least. This
family widens chat with other request shapes over other subjects: things to describe, hobbies to start,
what to cook from what is in the fridge, trips, explanations for a named audience, decisions, idea
lists, short creative pieces, household problems and rewording. Nothing here is copied from the
benchmark prompts, and prompts.build drops any prompt that shares a five-word run with them.
"""
from __future__ import annotations

import itertools

from .prompt_words import expand

THINGS = [
    "octopuses", "the Great Wall of China", "hot air balloons", "sourdough bread", "the Amazon river",
    "lightning", "coral reefs", "the Eiffel Tower", "submarines", "glaciers", "the human brain", "owls",
    "the Olympic Games", "wind turbines", "maple syrup", "the Sahara", "satellites", "whales", "tulips",
    "the Moon landing", "pyramids", "elephants", "bamboo", "the stock market", "comets", "windmills",
    "the Northern Lights", "bees' honeycombs", "castles", "the Pacific Ocean", "hummingbirds", "sushi",
    "the Silk Road", "skyscrapers", "tides", "the bicycle's invention", "penicillin", "volcanic islands",
    "the Dead Sea", "chameleons", "ballet", "the Mona Lisa", "space stations", "cacao farming", "tea ceremonies",
    "lighthouse keepers", "the first computers", "rice terraces", "sea turtles", "the Arctic", "kites",
    "opera", "the metric system", "bridges", "the Vikings", "fossils", "bonsai trees", "rainwater", "jellyfish",
    "the Andes", "paper money", "clocks", "the telescope", "migrating birds", "wolves", "olive oil",
    "the Great Barrier Reef", "steam engines", "crossword puzzles", "the Nile", "wildfires", "snowflakes",
    "the Himalayas", "Shakespeare's plays", "antibiotics", "geysers", "frogs", "bread baking in ancient Rome",
]
THING_FORMS = [
    "Tell me something interesting about {x}.", "Write a short paragraph about {x}.",
    "What are three surprising facts about {x}?", "Give me a two-sentence summary of {x}.",
    "Why are {x} worth learning about?", "What is a common myth about {x}?",
    "Write a short quiz about {x}, with answers.", "What would a child find fascinating about {x}?",
]
HOBBIES = [
    "rock climbing", "baking bread", "birdwatching", "playing chess", "woodworking", "pottery", "sketching",
    "learning the ukulele", "home brewing kombucha", "hiking", "swimming", "calligraphy", "stargazing",
    "gardening", "sewing", "geocaching", "playing tennis", "rollerblading", "making candles",
    "writing poetry", "film photography", "keeping chickens", "learning magic tricks", "fishing",
    "beekeeping", "salsa dancing", "bouldering", "playing the drums", "embroidery", "cycling to work",
    "making jam", "playing board games with friends", "kayaking", "journaling", "learning sign language",
    "volunteering at an animal shelter", "collecting stamps", "building model trains", "trail running",
]
HOBBY_FORMS = [
    "I want to take up {x}. What do I need to begin?", "How can I get better at {x}?",
    "Is {x} a good hobby for someone with little free time?", "What does the first month of {x} usually look like?",
    "What are the hidden costs of {x}?",
]
INGREDIENTS = [
    "rice", "eggs", "a tin of tomatoes", "chickpeas", "pasta", "a courgette", "feta", "potatoes", "lentils",
    "a lemon", "carrots", "tofu", "mushrooms", "bread", "yoghurt", "peppers", "spinach", "a sweet potato",
    "tuna", "noodles", "cabbage", "oats", "apples", "garlic",
]
MEALS = ["lunch", "dinner", "a quick breakfast", "a packed lunch"]
TRIPS = [
    "a weekend at the seaside", "a week of camping in the forest", "a city break in winter",
    "a long train journey", "a ski holiday", "a business trip of three days", "a music festival",
    "a beach holiday with a baby", "a cycling tour of a week", "visiting grandparents for a month",
    "a school trip to a museum", "a canoe trip on a river", "a summer trip to a hot country",
    "a road trip with two dogs", "a hostel stay abroad", "a wedding in another city",
]
TRIP_FORMS = [
    "What should I pack for {x}?", "How can I keep the costs down on {x}?",
    "What could go wrong on {x}, and how do I prepare?", "Make a checklist for the day before {x}.",
]
TOPICS = [
    "how vaccines train the body", "why the seasons change", "how a bank loan works", "what DNA is",
    "how email gets delivered", "how a rainbow forms", "why we pay taxes", "what an atom is",
    "how plants drink water", "how elections are counted", "what a calorie is", "how magnets work",
    "why ice is slippery", "how a fridge keeps food cold", "what a website's server does",
    "how bees make honey", "why the ocean is salty", "how interest on savings works",
    "what makes a sound loud", "how a car engine works", "why some metals rust", "what a computer virus is",
    "how clouds form", "what a budget is", "how a compass works", "why bread needs yeast",
    "how tides are caused by the Moon", "what a mortgage is", "how phones connect to each other",
    "why exercise makes you tired", "how recycling plants sort rubbish", "what an earthquake is",
]
AUDIENCES = [
    "a seven-year-old", "my grandmother", "a new colleague", "a curious teenager", "someone who speaks little English",
    "a busy manager in one minute", "a class of students",
]
DECISIONS = [
    ("rent a flat", "buy one"), ("learn Python", "learn JavaScript first"), ("cycle to work", "take the bus"),
    ("adopt a cat", "adopt a dog"), ("study at night", "study in the morning"), ("buy a new phone", "repair my old one"),
    ("take a gap year", "start university straight away"), ("cook at home", "order takeaway on weeknights"),
    ("go to the gym", "exercise at home"), ("read paper books", "use an e-reader"),
    ("freelance", "take a full-time job"), ("fly", "take the train for a 600 km trip"),
    ("pay off my loan early", "save the money"), ("learn piano", "learn guitar"),
    ("live in the city centre", "live in the suburbs"), ("use a paper planner", "use a calendar app"),
    ("grow vegetables", "buy them at the market"), ("buy a used car", "buy a new car"),
]
DECISION_FORMS = [
    "Should I {a} or {b}?", "Help me decide: {a} or {b}? List the trade-offs.",
    "What questions should I ask myself before I choose whether to {a} or {b}?",
]
OCCASIONS = [
    "a rainy afternoon indoors", "a tenth wedding anniversary", "a retirement party", "a team lunch",
    "a first date", "a child's science fair project", "a school fundraiser", "a cheap weekend in my own town",
    "a housewarming gift", "a long car journey with kids", "a book club discussion", "a garden party",
    "a blog about cooking", "a small online shop's name", "a family reunion", "a neighbourhood clean-up day",
    "a vegetarian barbecue", "a gift for a coworker who is leaving", "a short team icebreaker",
    "a New Year's resolution", "a podcast episode", "a photo walk in the city", "a picnic menu",
    "a low-cost birthday party", "a winter evening with friends",
]
IDEA_FORMS = ["Give me five ideas for {x}.", "Suggest three creative ideas for {x}.", "List ten quick ideas for {x}."]
GENRES = [
    "a limerick", "a short fable with a moral", "a diary entry", "a riddle", "the chorus of a song",
    "a two-line joke", "a short dialogue between two friends", "a bedtime story", "a motivational message",
]
SUBJECTS = [
    "a lost umbrella", "a robot learning to cook", "the first day of spring", "a cat who hates Mondays",
    "a train that is always late", "a lighthouse in a storm", "a grandmother's secret recipe",
    "an astronaut who misses home", "a shy dragon", "a forgotten library book", "a snowman in summer",
    "a village without clocks", "a talking houseplant", "a lost key", "a hedgehog crossing a road",
    "a new student at school", "a broken bicycle", "the last slice of cake", "an old map", "a noisy neighbour",
    "a cloud that wanted to rain", "a clumsy wizard", "a market at dawn", "a tired postman",
]
PROBLEMS = [
    "my sink drains very slowly", "my laptop fan is always loud", "my bread comes out dense",
    "my tomatoes have yellow leaves", "my phone will not charge", "my dog pulls on the lead",
    "my shirts shrink in the wash", "my Wi-Fi drops every evening", "my rice is always sticky",
    "my fridge smells bad", "my cat scratches the sofa", "my car makes a squeak when braking",
    "my headphones only play on one side", "my printer says it is offline", "my cake sinks in the middle",
    "my windows fog up every morning", "my basil keeps wilting", "my toddler will not sleep",
    "my knees hurt after running", "my emails go to people's spam folders",
]
PROBLEM_FORMS = ["{x}. What could cause this?", "{x}. How can I sort that out?", "{x}. What should I try first?"]
SENTENCES = [
    "we cant come to the meeting tomorrow sorry", "the report is late because the data was wrong",
    "please send me the files asap", "i think your idea is not very good", "the party is at mine at 8",
    "our shop will close early on friday", "i need the money back for the broken chair",
    "thanks for the help yesterday it was great", "the train was delayed so i missed the class",
    "can you fix the bug before lunch", "we are raising prices next month", "your order has been shipped",
    "i did not like the food at all", "the new software update is ready to install",
    "the team won the match after a hard game", "the library will be closed for repairs",
]
JOBS = [
    "nurse", "librarian", "pilot", "plumber", "software tester", "zookeeper", "firefighter", "baker",
    "park ranger", "translator", "electrician", "museum curator", "dentist", "bus driver", "architect",
    "farmer", "journalist", "data analyst", "chef", "primary school teacher", "vet", "carpenter",
    "air traffic controller", "gardener", "pharmacist", "sound engineer", "beekeeper", "tailor",
]
JOB_FORMS = ["What does a {x} do all day?", "What skills does a {x} need?", "How would I become a {x}?"]
PLACES = [
    "a small island", "a houseboat", "a farm far from town", "a tiny flat in a big city", "a mountain village",
    "a research station in Antarctica", "a lighthouse", "a desert town", "a student house with five people",
    "a caravan", "a fishing village", "a place where it rains most days",
]
PLACE_FORMS = ["What is it like to live in {x}?", "What are the good and bad sides of living in {x}?",
               "Write a short description of a morning in {x}."]
REWRITE_FORMS = [
    "Rewrite this to sound more formal: \"{x}\"", "Make this message friendlier: \"{x}\"",
    "Fix the spelling and grammar: \"{x}\"", "Rewrite this for a young child: \"{x}\"",
]


def wider_requests() -> list[str]:
    """Every request of this family, in a fixed order (prompts.build shuffles it with its own seed)."""
    out = expand(THINGS, THING_FORMS) + expand(HOBBIES, HOBBY_FORMS)
    for i, (a, b, c) in enumerate(itertools.combinations(INGREDIENTS, 3)):
        if i % 3 == 0:  # every third combination: ~670 fridges, every ingredient in many
            out.append(f"I have {a}, {b} and {c}. What can I make for {MEALS[i % len(MEALS)]}?")
    out += expand(TRIPS, TRIP_FORMS)
    out += expand(AUDIENCES, [f"Explain {t} to {{x}}." for t in TOPICS])
    out += expand(DECISIONS, DECISION_FORMS)
    out += expand(OCCASIONS, IDEA_FORMS)
    out += expand(SUBJECTS, [f"Write {g} about {{x}}." for g in GENRES])
    out += expand([x[0].upper() + x[1:] for x in PROBLEMS], PROBLEM_FORMS)
    out += expand(SENTENCES, REWRITE_FORMS) + expand(JOBS, JOB_FORMS) + expand(PLACES, PLACE_FORMS)
    return out
