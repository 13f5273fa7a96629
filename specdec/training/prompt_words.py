"""Word lists for the head trainer's composed prompts (training/prompts.py): everyday requests.

A head learns the target's answers to what it is asked; a prompt set built from one sentence pattern
teaches it that pattern's answers and little else (the first shipped SmolLM2 head accepted 0.39 of its
drafts on held-out prompts of its own templates but 0.20 on the benchmark's everyday questions). These
lists widen the set: many request forms (how-to, why, differences, plans, recipes, letters, advice) over
many subjects. Nothing here is copied from the benchmark prompts, and prompts.build drops any prompt that
shares a five-word run with them.
"""
from __future__ import annotations

HOW_TO = [
    "clean a cast iron pan", "change a flat bicycle tyre", "write a good cover letter", "fall asleep faster",
    "make friends in a new town", "start running without getting injured", "remove a coffee stain from a shirt",
    "keep a sourdough starter alive", "negotiate a higher salary", "organise a small kitchen",
    "learn to touch type", "prepare for a job interview", "stop procrastinating", "care for a cactus",
    "set up a home budget", "brew a good cup of tea", "teach a dog to sit", "plan a road trip",
    "back up my photos", "improve my handwriting", "write a thank-you note", "reduce food waste at home",
    "memorise a short speech", "choose a good watermelon", "fix a squeaky door", "keep bread fresh longer",
    "study for a maths test", "paint a room quickly", "make a paper airplane that flies far",
    "say no politely to extra work", "save for a holiday", "clean a laptop keyboard", "grow basil indoors",
    "take better photos with a phone", "keep a journal", "pack a suitcase efficiently", "cook rice perfectly",
    "calm down before an exam", "get better at chess", "write a short story", "boil an egg",
    "learn the guitar as an adult", "sharpen a kitchen knife", "make a simple website",
    "stay focused when working from home", "read more books in a year", "split a bill fairly with friends",
    "take care of a new puppy", "make cold brew coffee", "apologise to a friend", "repot a plant",
    "choose a pair of running shoes", "write a good email subject line", "wash a wool sweater",
    "start learning to draw", "plan a birthday surprise", "keep my phone battery healthy",
    "improve my posture at a desk", "make a weekly meal plan", "give useful feedback to a coworker",
]
WHY = [
    "the sky is blue", "leaves change colour in autumn", "we dream", "ice floats on water", "cats purr",
    "onions make you cry", "the sea is salty", "we get hiccups", "planes leave white trails in the sky",
    "bread rises", "metal feels colder than wood", "we yawn", "the moon has phases", "popcorn pops",
    "birds fly south for the winter", "coffee keeps people awake", "rubber bands stretch", "thunder is loud",
    "some people are left-handed", "milk goes sour", "we have seasons", "stars twinkle",
    "soap removes grease", "our voices sound different on recordings", "glass is transparent",
    "deserts are cold at night", "bananas turn brown", "ears pop on airplanes", "we need sleep",
    "some fruits are sweet and others are sour", "the ocean has tides", "salt melts ice on roads",
    "mirrors flip left and right but not up and down", "fireflies glow", "muscles get sore after exercise",
    "the Earth has a magnetic field", "rain clouds are grey", "spicy food feels hot", "ships float",
    "we get goosebumps",
]
PAIRS = [
    ("a lake", "a pond"), ("baking soda", "baking powder"), ("a crocodile", "an alligator"),
    ("a simile", "a metaphor"), ("RAM", "storage"), ("a loan", "a grant"), ("jam", "jelly"),
    ("a hurricane", "a tornado"), ("an emu", "an ostrich"), ("a latte", "a cappuccino"),
    ("speed", "velocity"), ("a stock", "a bond"), ("a frog", "a toad"), ("a comet", "an asteroid"),
    ("a democracy", "a republic"), ("affect", "effect"), ("a violin", "a viola"), ("a list", "a tuple in Python"),
    ("a boat", "a ship"), ("renting", "buying a home"), ("a mountain", "a hill"), ("a seed", "a nut"),
    ("sunrise", "sunset colours"), ("a cold", "the flu"), ("a novel", "a novella"), ("a rabbit", "a hare"),
    ("an app", "a website"), ("a debit card", "a credit card"), ("yoga", "pilates"), ("a sea", "an ocean"),
    ("a museum", "a gallery"), ("wool", "cotton"), ("a city", "a town"), ("a diary", "a blog"),
    ("weight", "mass"), ("a recipe", "a cooking method"), ("a sprint", "a marathon"), ("a fruit", "a vegetable"),
]
CONCEPTS = [
    "compound interest", "photosynthesis", "inflation", "a carbon footprint", "machine learning", "gravity",
    "a food chain", "supply and demand", "a password manager", "the water cycle", "a credit score",
    "evolution", "a sonnet", "an index fund", "renewable energy", "the immune system", "a budget deficit",
    "a spreadsheet formula", "a thesaurus", "cloud computing", "a time zone", "a leap year", "an eclipse",
    "a vaccine", "a mortgage", "a recession", "the scientific method", "a haiku", "an algorithm",
    "a metaphor", "an ecosystem", "a tax return", "a hypothesis", "biodiversity", "a podcast",
    "a pension", "a food allergy", "jet lag", "a firewall", "a cover letter", "a nonprofit organisation",
    "the greenhouse effect", "a balanced diet", "a programming language", "an election", "open source software",
]
DISHES = [
    "a simple tomato soup", "pancakes", "a vegetable stir fry", "banana bread", "a lentil curry",
    "guacamole", "a Greek salad", "overnight oats", "a mushroom risotto", "homemade pizza dough",
    "a chickpea salad", "roasted vegetables", "a fruit smoothie", "scrambled eggs", "a bean chilli",
    "apple crumble", "a potato gratin", "a quick pasta sauce", "hummus", "vegetable fried rice",
    "a lemon cake", "a simple omelette", "oat cookies", "a pumpkin soup", "garlic bread",
]
WRITING = [
    "an email to my team announcing that the office will be closed on Friday",
    "a note to a neighbour about a parcel I accepted for them", "a short message congratulating a friend on a new job",
    "a polite reminder to a client about an unpaid invoice", "a birthday message for my grandmother",
    "a short introduction of myself for a new online class", "an out-of-office reply for a one-week holiday",
    "a message asking my manager for a day off next week", "a review of a restaurant I liked",
    "a letter to a local council asking for more bicycle lanes", "a short bio for a conference speaker page",
    "a message to cancel a dentist appointment", "an invitation to a small garden party",
    "a thank-you email after a job interview", "a complaint about a late delivery, kept polite",
    "a welcome message for new members of a book club", "a short toast for a friend's wedding",
    "a notice asking people to keep the shared fridge clean", "a request for a reference letter from a teacher",
    "an apology for missing a meeting", "a listing to sell a used bicycle", "a note to thank a volunteer",
    "a reply declining a party invitation politely", "a short announcement of a new product feature",
]
PLANS = [
    "a three-day trip to a city I have never visited", "a week of healthy lunches for work",
    "a study schedule for learning Spanish in three months", "a beginner's four-week running plan",
    "a rainy Sunday with two small children", "a cheap date night at home", "a productive morning routine",
    "a small team-building afternoon for eight people", "a weekend cleaning and decluttering the flat",
    "a picnic for six people", "the first week in a new job", "a reading list for a summer holiday",
    "a budget for a student living alone", "a small vegetable garden for a beginner",
    "a family game night", "a two-hour workshop about saving energy at home",
]
ADVICE = [
    "I feel nervous about speaking in meetings", "my houseplants keep dying", "I can't decide which laptop to buy",
    "my roommate never does the dishes", "I want to eat less sugar", "I keep forgetting people's names",
    "my code review comments upset a colleague", "I get distracted by my phone while studying",
    "I want to start saving but my income is small", "my neighbour's dog barks all night",
    "I have too many browser tabs open all the time", "I am moving abroad next month",
    "I want to learn programming but do not know where to start", "my bike chain keeps slipping",
    "I find it hard to wake up early", "I have to give a presentation tomorrow",
    "my old laptop has become very slow", "I want to get back into reading",
]
EVERYDAY_FORMS = [
    (HOW_TO, ["How do I {x}?", "What is the easiest way to {x}?", "Can you give me step-by-step instructions to {x}?",
              "I want to {x}. Where should I start?", "What should I avoid when I {x}?"]),
    (WHY, ["Can you explain why {x}?", "Why is it that {x}?", "I have always wondered why {x}. What is the reason?"]),
    (PAIRS, ["What is the difference between {a} and {b}?", "How do {a} and {b} differ?",
             "Is {a} the same as {b}? Explain briefly."]),
    (CONCEPTS, ["What is {x}?", "Explain {x} in two short paragraphs.", "Give a simple example of {x}.",
                "What does {x} mean, and why does it matter?", "How would you explain {x} to a teenager?"]),
    (DISHES, ["Give me a recipe for {x}.", "How do I make {x} at home?", "What do I need to cook {x}?"]),
    (WRITING, ["Write {x}.", "Please draft {x}.", "Help me write {x}."]),
    (PLANS, ["Plan {x}.", "Make a simple plan for {x}.", "Suggest an outline for {x}."]),
    (ADVICE, ["{x}. What should I do?", "{x}. Any advice?", "{x}. Can you help me think it through?"]),
]
CODE_EDITS = [
    "Add a docstring to this Python function:", "Explain what this Python function does:",
    "Add type hints to this function:", "Rewrite this function so it is easier to read:",
    "Write two unit tests for this function:", "Rename the variables in this function to clearer names:",
    "Is there a bug in this function? Explain.", "Add comments to this code:",
]


def expand(subjects: list, forms: list[str]) -> list[str]:
    """Every form filled with every subject, form by form: a subject is a string ({x}) or a pair ({a}, {b})."""
    return [form.format(a=item[0], b=item[1]) if isinstance(item, tuple) else form.format(x=item)
            for form in forms for item in subjects]


def everyday_requests() -> list[str]:
    """Every (form, subject) request, in a fixed order."""
    return [request for subjects, forms in EVERYDAY_FORMS for request in expand(subjects, forms)]
