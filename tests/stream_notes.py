"""Notes for stream recall tests: distinct facts, one per frame; each question names exactly one."""

NOTES = [
    ("Maria", "locker code", "4417"),
    ("the red truck", "parking spot", "B12"),
    ("Professor Okafor", "office", "room 305"),
    ("the bakery", "opening hour", "six in the morning"),
    ("the cat", "favourite toy", "a blue feather"),
    ("the train to Lyon", "platform", "platform nine"),
    ("Jonas", "password hint", "his first dog"),
    ("the museum", "ticket price", "twelve euros"),
    ("the ship Aurora", "captain", "Elena Vasquez"),
    ("the garden", "rarest flower", "a black tulip"),
    ("the orchestra", "conductor", "Hiro Tanaka"),
    ("the volcano", "height", "3,200 metres"),
]
