"""The OpenAI API's text: request parsing and validation, response and SSE bodies, tokenizer,
detokenizer."""
