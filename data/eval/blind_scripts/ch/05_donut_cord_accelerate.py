# Donut fine-tuning for receipt parsing (CORD-v2), accelerate edition.
#
#   accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
#       05_donut_cord_accelerate.py --output_dir out/donut-cord
import argparse
import json
import math
import os
import random
import re

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from nltk import edit_distance
from torch.utils.data import DataLoader, Dataset
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_scheduler

logger = get_logger(__name__)

TASK_START = "<s_cord-v2>"


def json2token(obj, new_special_tokens, sort_json_key=True):
    """Convert a ground-truth json into the Donut token sequence."""
    if isinstance(obj, dict):
        if len(obj) == 1 and "text_sequence" in obj:
            return obj["text_sequence"]
        out = ""
        keys = sorted(obj.keys(), reverse=True) if sort_json_key else obj.keys()
        for k in keys:
            new_special_tokens.update([f"<s_{k}>", f"</s_{k}>"])
            out += f"<s_{k}>" + json2token(obj[k], new_special_tokens, sort_json_key) + f"</s_{k}>"
        return out
    if isinstance(obj, list):
        return "<sep/>".join(json2token(x, new_special_tokens, sort_json_key) for x in obj)
    return str(obj)


class CordDataset(Dataset):
    def __init__(self, hf_split, processor, max_length, train):
        self.ds = hf_split
        self.processor = processor
        self.max_length = max_length
        self.train = train
        self.targets = []
        self.special = set()
        for sample in self.ds:
            gt = json.loads(sample["ground_truth"])
            gts = gt["gt_parses"] if "gt_parses" in gt else [gt["gt_parse"]]
            self.targets.append([json2token(g, self.special) + processor.tokenizer.eos_token for g in gts])

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        image = self.ds[i]["image"].convert("RGB")
        pixel_values = self.processor(image, random_padding=self.train, return_tensors="pt").pixel_values[0]
        target = random.choice(self.targets[i]) if self.train else self.targets[i][0]
        ids = self.processor.tokenizer(target, add_special_tokens=False, max_length=self.max_length,
                                       padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": labels, "target": target, "index": i}


def collate(batch):
    return {
        "pixel_values": torch.stack([b["pixel_values"] for b in batch]),
        "labels": torch.stack([b["labels"] for b in batch]),
        "index": torch.tensor([b["index"] for b in batch]),
        "target": [b["target"] for b in batch],
    }


def normalized_ed(pred, gt):
    pred = re.sub(r"<.*?>", "", pred, count=1).strip()
    gt = re.sub(r"<.*?>", "", gt, count=1).strip()
    return edit_distance(pred, gt) / max(len(pred), len(gt), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    ap.add_argument("--dataset", default="naver-clova-ix/cord-v2")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--image_size", type=int, nargs=2, default=[1280, 960])
    ap.add_argument("--max_length", type=int, default=768)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup_steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2022)
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.image_size[0], "width": args.image_size[1]}
    processor.image_processor.do_align_long_axis = False
    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained, device_map="auto",
                                                      torch_dtype=torch.float32)
    model.config.encoder.image_size = args.image_size
    model.config.decoder.max_length = args.max_length

    raw = load_dataset(args.dataset)
    train_ds = CordDataset(raw["train"], processor, args.max_length, train=True)
    val_ds = CordDataset(raw["validation"], processor, args.max_length, train=False)

    # special tokens are derived from the train split, which is identical on every process
    new_tokens = sorted(train_ds.special | val_ds.special) + [TASK_START]
    processor.tokenizer.add_special_tokens({"additional_special_tokens": new_tokens})
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK_START)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=4, shuffle=False, collate_fn=collate, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # the prepared scheduler is stepped once per process for every optimizer update
    updates_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / args.grad_accum)
    scheduler = get_scheduler("cosine", optimizer,
                              num_warmup_steps=args.warmup_steps * accelerator.num_processes,
                              num_training_steps=updates_per_epoch * args.epochs * accelerator.num_processes)

    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)
    accelerator.init_trackers("donut-cord", config=vars(args))

    best = float("inf")
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                out = model(pixel_values=batch["pixel_values"], labels=batch["labels"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 25 == 0:
                    accelerator.log({"train/loss": out.loss.item(), "lr": scheduler.get_last_lr()[0]},
                                    step=global_step)

        # validation: normalised edit distance of generated sequences
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        scores = []
        for batch in val_loader:
            bsz = batch["pixel_values"].shape[0]
            prompt = torch.full((bsz, 1), unwrapped.config.decoder_start_token_id,
                                device=accelerator.device)
            with torch.no_grad():
                seqs = unwrapped.generate(batch["pixel_values"], decoder_input_ids=prompt,
                                          max_length=args.max_length, num_beams=1, early_stopping=True,
                                          pad_token_id=processor.tokenizer.pad_token_id,
                                          eos_token_id=processor.tokenizer.eos_token_id,
                                          bad_words_ids=[[processor.tokenizer.unk_token_id]])
            texts = processor.batch_decode(seqs)
            ed = torch.tensor([normalized_ed(t.replace(processor.tokenizer.pad_token, ""), g)
                               for t, g in zip(texts, batch["target"])], device=accelerator.device)
            scores.append(accelerator.gather_for_metrics(ed))
        val_ed = torch.cat(scores).mean().item()
        accelerator.print(f"epoch {epoch}: val normalised edit distance {val_ed:.4f}")
        accelerator.log({"val/norm_ed": val_ed}, step=global_step)

        accelerator.wait_for_everyone()
        if val_ed < best:
            best = val_ed
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
