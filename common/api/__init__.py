"""The OpenAI API's text, shared by the router and `pdserve run-batch`.

`requests` validates request bodies, `prompts` turns a request into engine inputs, `choice`
accumulates one choice's generated tokens into text, `responses` builds whole bodies and SSE
chunks; `tokenizer` and `detokenizer` sit underneath. Wire messages between processes are in
`common.protocol`, not here.
"""
