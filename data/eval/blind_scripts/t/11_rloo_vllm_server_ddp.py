"""
RLOO (REINFORCE leave-one-out) against a learned reward model, with rollouts
from a vLLM server and a DDP-trained policy. The server runs on its own GPU;
training uses the rest of the node.

Launch on one 8-GPU node:

    CUDA_VISIBLE_DEVICES=7 trl vllm-serve --model Qwen/Qwen2.5-1.5B-Instruct \
        --port 8000 --gpu_memory_utilization 0.9 &
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 torchrun --standalone --nproc_per_node=8 \
        11_rloo_vllm_server_ddp.py --policy Qwen/Qwen2.5-1.5B-Instruct \
        --reward_model OpenAssistant/reward-model-deberta-v3-large-v2 --out runs/rloo_q15
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl.extras.vllm_client import VLLMClient


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="Qwen/Qwen2.5-1.5B-Instruct")
    p.add_argument("--reward_model", default="OpenAssistant/reward-model-deberta-v3-large-v2")
    p.add_argument("--out", default="runs/rloo")
    p.add_argument("--server_port", type=int, default=8000)
    p.add_argument("--k", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompts_per_rank", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=400)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sync_every", type=int, default=1)
    p.add_argument("--save_every", type=int, default=200)
    return p.parse_args()


def seq_logprob(model, ids, attn, start):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    pos = torch.arange(lp.shape[1], device=ids.device)[None]
    m = (pos >= (start[:, None] - 1)) & (attn[:, 1:] > 0)
    return (lp * m).sum(1), m.sum(1)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    K = args.k

    tok = AutoTokenizer.from_pretrained(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(dev)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model, torch_dtype=torch.bfloat16).to(dev)
    rm.eval().requires_grad_(False)
    policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)

    client = None
    if rank == 0:
        client = VLLMClient(server_port=args.server_port, connection_timeout=300)
        client.init_communicator()

    ds = load_dataset("HuggingFaceH4/ultrafeedback_binarized", split="train_prefs")
    ds = ds.map(lambda ex: {"q": ex["prompt"]}, remove_columns=ds.column_names)
    ds = ds.filter(lambda ex: len(ex["q"]) < 1500)
    sampler = DistributedSampler(ds, shuffle=True, seed=3, drop_last=True)
    dl = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, collate_fn=lambda b: [x["q"] for x in b])

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for questions in dl:
            t0 = time.time()
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in questions]
            gathered = [None] * world
            dist.all_gather_object(gathered, prompts)
            box = [None]
            if rank == 0:
                flat = [p for chunk in gathered for p in chunk]
                box[0] = client.generate(flat, n=K, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
            dist.broadcast_object_list(box, src=0)
            n_local = len(prompts) * K
            completions = box[0][rank * n_local:(rank + 1) * n_local]

            p_ids = tok(prompts, add_special_tokens=False).input_ids
            rows = [p_ids[i // K] + list(c) for i, c in enumerate(completions)]
            starts = torch.tensor([len(p_ids[i // K]) for i in range(n_local)], device=dev)
            L = max(map(len, rows))
            ids = torch.full((n_local, L), tok.pad_token_id, device=dev)
            attn = torch.zeros((n_local, L), dtype=torch.long, device=dev)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r, device=dev)
                attn[i, :len(r)] = 1

            with torch.no_grad():
                texts = tok.batch_decode([list(c) for c in completions], skip_special_tokens=True)
                rm_in = rm_tok([questions[i // K] for i in range(n_local)], texts, return_tensors="pt",
                               padding=True, truncation=True, max_length=1024).to(dev)
                scores = rm(**rm_in).logits.squeeze(-1).float()
                ref_lp = torch.cat([seq_logprob(ref, ids[s:s + args.micro_batch], attn[s:s + args.micro_batch],
                                                starts[s:s + args.micro_batch])[0]
                                    for s in range(0, n_local, args.micro_batch)])

            opt.zero_grad(set_to_none=True)
            kl_sum, loss_sum = torch.zeros((), device=dev), torch.zeros((), device=dev)
            n_micro = (n_local + args.micro_batch - 1) // args.micro_batch
            # rewards are computed from the sampling-time KL, so the leave-one-out baseline
            # needs the policy log-probs of the whole local batch first
            with torch.no_grad():
                pol_lp_all = torch.cat([seq_logprob(policy.module, ids[s:s + args.micro_batch],
                                                    attn[s:s + args.micro_batch], starts[s:s + args.micro_batch])[0]
                                        for s in range(0, n_local, args.micro_batch)])
            r = (scores - args.kl_coef * (pol_lp_all - ref_lp)).view(-1, K)
            baseline = (r.sum(1, keepdim=True) - r) / (K - 1)
            adv = (r - baseline).view(-1)
            for s in range(0, n_local, args.micro_batch):
                sl = slice(s, s + args.micro_batch)
                lp, _ = seq_logprob(policy, ids[sl], attn[sl], starts[sl])
                loss = -(adv[sl] * lp).sum() / n_local
                loss.backward()
                loss_sum += loss.detach()
                kl_sum += (lp.detach() - ref_lp[sl]).sum() / n_local
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            step += 1

            if step % args.sync_every == 0:
                if rank == 0:
                    for name, p in policy.module.named_parameters():
                        client.update_named_param(name, p.data)
                    client.reset_prefix_cache()
                dist.barrier()

            log = torch.stack([loss_sum, kl_sum, scores.mean()])
            dist.all_reduce(log, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {log[0]:.4f} kl {log[1]:.3f} rm {log[2]:.3f} "
                      f"({time.time() - t0:.1f}s, {n_micro} micro)", flush=True)

            if step % args.save_every == 0 and rank == 0:
                policy.module.save_pretrained(os.path.join(args.out, f"step{step}"))
                tok.save_pretrained(os.path.join(args.out, f"step{step}"))
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        client.close_communicator()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
