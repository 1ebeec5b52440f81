#!/usr/bin/env python3
"""Chats from the plays: each speech as the user's turn and the speech that answers it as the
assistant's, as JSON lines of `messages` (what `prepare-data` reads).

    scripts/fetch-shakespeare.sh data
    scripts/plays-chat.py data/shakespeare.txt data/plays-chat.jsonl [--limit N] [--max-words W]

A speech is a speaker's line in capitals ending in a period ("BERTRAM.") and the lines under it
up to a blank line, stage directions in brackets dropped; a scene or act heading, or an exit,
ends a conversation, so that no pair spans two scenes.
"""
import argparse
import json
import re

SPEAKER = re.compile(r"^[A-Z][A-Z' .-]*\.$")
BREAK = re.compile(r"^(ACT|SCENE|\[Exit|\[Exeunt)")


def speeches(lines):
    """Yields each speech's text, or None where a conversation ends."""
    speech = None
    for raw in lines:
        line = raw.strip()
        if BREAK.match(line):
            if speech:
                yield " ".join(speech)
            speech = None
            yield None
        elif SPEAKER.match(line) and len(line) > 2:
            if speech:
                yield " ".join(speech)
            speech = []
        elif not line:
            if speech:
                yield " ".join(speech)
            speech = None
        elif speech is not None and not line.startswith("["):
            speech.append(line)
    if speech:
        yield " ".join(speech)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plays")
    parser.add_argument("output")
    parser.add_argument("--limit", type=int, default=None, help="at most this many chats")
    parser.add_argument("--max-words", type=int, default=None, help="leave out chats with a longer speech")
    args = parser.parse_args()
    with open(args.plays, encoding="utf-8") as f:
        lines = f.read().splitlines()
    written, previous = 0, None
    with open(args.output, "w", encoding="utf-8") as out:
        for speech in speeches(lines):
            short = args.max_words is None or all(
                len(s.split()) <= args.max_words for s in (previous or "", speech or "")
            )
            if previous and speech and short:
                messages = [
                    {"role": "user", "content": previous},
                    {"role": "assistant", "content": speech},
                ]
                out.write(json.dumps({"messages": messages}) + "\n")
                written += 1
                if args.limit is not None and written >= args.limit:
                    break
            previous = speech
    print(f"{args.output}: {written} chats")


if __name__ == "__main__":
    main()
