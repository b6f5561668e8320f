"""What a fitted model decides and shows: the best draft length per rate, break-even rates, capacity plans,
plain-language explanations and plots."""
