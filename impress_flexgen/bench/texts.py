"""Short public-domain passages used as built-in prompts."""

PROMPTS = (
    # Jane Austen, Pride and Prejudice (1813), chapter 1
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters.",
    # King James Bible (1611), Genesis 1:1-3
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
    "the face of the waters. And God said,",
    # William Shakespeare, Sonnet 18 (1609)
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: Rough "
    "winds do shake the darling buds of May, And summer's lease hath all too short a date;",
)
