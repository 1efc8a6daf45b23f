"""Writes specserve/bench/data/json-extraction.jsonl: the JSON extraction workload (a text, a schema, the
record it describes), MT-Bench's format with each line's schema under "json_schema"."""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "specserve" / "bench" / "data" / "json-extraction.jsonl"


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }


# Strings bounded as a real extraction schema bounds them: every answer then ends within the bench's
# token budget (an unbounded string lets a small model repeat itself inside it until the budget runs out).
STRING, INTEGER, NUMBER, BOOLEAN = (
    {"type": "string", "maxLength": 60},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
)
STRINGS = {"type": "array", "items": STRING, "maxItems": 5}
SCHEMAS = {
    "person": _object(
        {"name": STRING, "age": INTEGER, "occupation": STRING, "city": STRING, "languages": STRINGS}
    ),
    "product": _object(
        {"name": STRING, "brand": STRING, "price_usd": NUMBER, "in_stock": BOOLEAN, "colors": STRINGS}
    ),
    "event": _object({"title": STRING, "date": STRING, "venue": STRING, "city": STRING, "speakers": STRINGS}),
    "book": _object(
        {"title": STRING, "author": STRING, "year": INTEGER, "pages": INTEGER, "genres": STRINGS}
    ),
}
TEXTS = {
    "person": [
        "Maria Lopez is a 34-year-old architect from Valencia. She speaks Spanish, Catalan and English.",
        "Tomasz Nowak, 52, works as a ship engineer in Gdansk and speaks Polish, German and Russian.",
        "Aiko Tanaka is a pianist living in Osaka. She is 27 and speaks Japanese and French.",
        "At 45, Daniel Okafor runs a bakery in Lagos; he speaks English, Yoruba and Igbo.",
    ],
    "product": [
        "The Nimbus X2 running shoe by Stridewell costs $129.99 and is in stock in blue, black and red.",
        "Lumora's DeskLite LED lamp sells for $45.50; it is currently out of stock, in white or grey.",
        "The KettlePro 1.7L from Hearthline is $59.00, available now in silver, cream and green.",
        "Orbit Audio's Pulse headphones cost $199.00 and are sold out in all colors: black and navy.",
    ],
    "event": [
        "PyCon Iberia takes place on 2027-03-14 at the Palacio de Congresos in Granada, with talks by"
        " Ana Ruiz and Luis Mora.",
        "The Northern Lights Data Summit is on 2027-05-02 at Harpa in Reykjavik; speakers are Jon"
        " Olafsson and Kari Lind.",
        "On 2027-09-21 the Rust Systems Day meets at the Kulturbrauerei in Berlin with Eva Schmidt,"
        " Paul Wagner and Lea Hoff.",
        "The Coastal Ecology Forum opens on 2027-06-10 at the Aquarium Hall in Monterey, with Dr. Sam"
        " Reyes speaking.",
    ],
    "book": [
        "'The Glass Orchard' by Helen Marsh, published in 2019, runs 342 pages and is a mystery and"
        " family drama.",
        "Ravi Menon's 'Monsoon Engines' (2021) is a 288-page science fiction novel with elements of"
        " adventure.",
        "Published in 1998, 'Salt and Cedar' by Lina Haddad is a 410-page historical novel and romance.",
        "'Quiet Arithmetic', a 196-page essay collection on mathematics and philosophy, was written by"
        " Ode Brun in 2015.",
    ],
}


def main() -> None:
    lines = []
    for kind, texts in TEXTS.items():
        schema = SCHEMAS[kind]
        for i, text in enumerate(texts):
            keys = ", ".join(schema["properties"])
            prompt = f"Extract the {kind} described below as JSON with the keys {keys}.\n\n{text}"
            record = {
                "question_id": f"{kind}-{i}",
                "category": kind,
                "turns": [prompt],
                "json_schema": schema,
            }
            lines.append(json.dumps(record))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {OUT.name}")


if __name__ == "__main__":
    main()
