"""Fine-tune NLLB-200 (distilled 600M) on an in-house English->Swahili corpus.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 12_nllb_finetune_accelerate_wandb.py \
        --train_tsv data/en_sw/train.tsv --dev_tsv data/en_sw/dev.tsv --output_dir runs/nllb_en_sw
"""
import argparse
import math
import os

import sacrebleu
import torch
import wandb
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_inverse_sqrt_schedule


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/nllb-200-distilled-600M")
    ap.add_argument("--train_tsv", required=True)
    ap.add_argument("--dev_tsv", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--src_lang", default="eng_Latn")
    ap.add_argument("--tgt_lang", default="swh_Latn")
    ap.add_argument("--max_len", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--label_smoothing", type=float, default=0.2)
    ap.add_argument("--eval_every", type=int, default=1500)
    ap.add_argument("--num_beams", type=int, default=4)
    ap.add_argument("--wandb_project", default="nllb-en-sw")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def evaluate(model, loader, tokenizer, accelerator, args):
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    forced_bos = tokenizer.convert_tokens_to_ids(args.tgt_lang)
    hyps, refs = [], []
    for batch in tqdm(loader, disable=not accelerator.is_local_main_process, desc="dev"):
        with torch.no_grad():
            out = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     forced_bos_token_id=forced_bos, num_beams=args.num_beams,
                                     max_new_tokens=args.max_len)
        out = accelerator.pad_across_processes(out, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        out, labels = accelerator.gather_for_metrics((out, labels))
        labels = labels.masked_fill(labels == -100, tokenizer.pad_token_id)
        hyps += tokenizer.batch_decode(out, skip_special_tokens=True)
        refs += tokenizer.batch_decode(labels, skip_special_tokens=True)
    model.train()
    bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
    chrf = sacrebleu.corpus_chrf(hyps, [refs], word_order=2).score
    return bleu, chrf, hyps[:5]


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    wandb.init(project=args.wandb_project, name=os.path.basename(args.output_dir), config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)

    def tok_fn(batch):
        return tokenizer(batch["src"], text_target=batch["tgt"], max_length=args.max_len, truncation=True)

    with accelerator.main_process_first():
        raw = load_dataset("csv", data_files={"train": args.train_tsv, "dev": args.dev_tsv}, delimiter="\t",
                           column_names=["src", "tgt"], quoting=3)
        data = raw.map(tok_fn, batched=True, remove_columns=["src", "tgt"], num_proc=4)
        data["train"] = data["train"].filter(lambda ex: len(ex["input_ids"]) > 2 and len(ex["labels"]) > 2)

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8)
    train_loader = DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                              num_workers=4, pin_memory=True)
    dev_loader = DataLoader(data["dev"], batch_size=64, collate_fn=collator)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model, optimizer, train_loader, dev_loader = accelerator.prepare(model, optimizer, train_loader, dev_loader)
    # inverse-sqrt is open-ended, so only the warmup needs scaling for the prepared scheduler
    scheduler = accelerator.prepare(get_inverse_sqrt_schedule(optimizer, args.warmup * accelerator.num_processes))
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=args.label_smoothing)

    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    accelerator.print(f"{len(data['train'])} pairs, {steps_per_epoch} updates/epoch on {accelerator.num_processes} GPUs")

    best_chrf, step = -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                labels = batch.pop("labels")
                logits = model(**batch).logits
                loss = ce(logits.float().view(-1, logits.size(-1)), labels.view(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    gnorm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % 50 == 0:
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                wandb.log({"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0],
                           "train/grad_norm": float(gnorm), "epoch": epoch}, step=step)

            if step % args.eval_every == 0:
                bleu, chrf, samples = evaluate(model, dev_loader, tokenizer, accelerator, args)
                accelerator.print(f"step {step}: BLEU {bleu:.2f} chrF++ {chrf:.2f} | {samples[0]}")
                wandb.log({"dev/bleu": bleu, "dev/chrf++": chrf}, step=step)
                if chrf > best_chrf:
                    best_chrf = chrf
                    accelerator.wait_for_everyone()
                    accelerator.unwrap_model(model).save_pretrained(
                        os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                        save_function=accelerator.save)
                    if accelerator.is_main_process:
                        tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "last"),
                                                    is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    wandb.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
