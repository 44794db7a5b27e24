"""The model worker: takes jobs from Redis, decodes them in batches, publishes the text."""
