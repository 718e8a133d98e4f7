"""Images: the request's media, decoding, each family's preprocessing, the prompt's features."""
