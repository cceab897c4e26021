//! `kvfabric hash`.

use std::io::Read;

use clap::Args;
use kvfabric::hash::{HashSeed, TokenBlockHasher};

#[derive(Debug, Args)]
#[command(after_help = "Tokens come from the arguments, or from stdin when there are none \
(separated by spaces, commas or newlines; brackets are ignored, so a JSON array works).\n\
Example: kvfabric hash --block-tokens 4 1 2 3 4 5 6 7 8")]
pub struct HashArgs {
    /// Tokens per block; a trailing partial block is not hashed.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value = "16")]
    block_tokens: String,
    /// A salt (for example a tenant id) mixed into the hash seed.
    #[arg(long)]
    salt: Option<String>,
    /// A LoRA adapter name mixed into the hash seed.
    #[arg(long)]
    lora: Option<String>,
    /// Print {"block_hashes": [...], "sequence_hashes": [...]}.
    #[arg(long)]
    json: bool,
    /// Token ids (u32).
    #[arg(allow_hyphen_values = true)]
    tokens: Vec<String>,
}

/// Parses token ids separated by whitespace or commas, ignoring `[` and `]`.
fn parse_tokens<'a>(words: impl Iterator<Item = &'a str>) -> anyhow::Result<Vec<u32>> {
    let mut tokens = Vec::new();
    for word in words {
        for t in word.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']') {
            if t.is_empty() {
                continue;
            }
            let id: u32 = t.parse().map_err(|_| {
                anyhow::anyhow!("token {} ({t:?}) is not a token id (0..=4294967295)", tokens.len())
            })?;
            tokens.push(id);
        }
    }
    Ok(tokens)
}

pub fn run(args: HashArgs) -> anyhow::Result<()> {
    let block_tokens: kvfabric::units::BlockTokens = match args.block_tokens.trim().parse() {
        Ok(n) => n,
        Err(_) => {
            anyhow::bail!("--block-tokens must be a whole number >= 1, got {:?}", args.block_tokens)
        }
    };
    let tokens = if args.tokens.is_empty() {
        let mut input = String::new();
        std::io::stdin().read_to_string(&mut input)?;
        parse_tokens(std::iter::once(input.as_str()))?
    } else {
        parse_tokens(args.tokens.iter().map(String::as_str))?
    };
    let seed = HashSeed::new(args.lora.as_deref(), args.salt.as_deref());
    let hasher = TokenBlockHasher::new(block_tokens, seed);
    let (blocks, seqs) = hasher.hash(&tokens);
    if args.json {
        let out = serde_json::json!({ "block_hashes": blocks, "sequence_hashes": seqs });
        println!("{out}");
        return Ok(());
    }
    println!("{:>5}  {:>20}  {:>20}", "block", "block_hash", "sequence_hash");
    for (i, (b, s)) in blocks.iter().zip(&seqs).enumerate() {
        println!("{i:>5}  {b:>20}  {s:>20}");
    }
    let rest = tokens.len() % block_tokens.as_usize();
    if rest > 0 {
        println!("({rest} trailing token(s) in a partial block, not hashed)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn separators_and_brackets() {
        let t = parse_tokens(["[1, 2,3", "4]\n5"].into_iter()).unwrap();
        assert_eq!(t, vec![1, 2, 3, 4, 5]);
        let err = parse_tokens(["1 x"].into_iter()).unwrap_err().to_string();
        assert!(err.contains("token 1") && err.contains("\"x\""), "{err}");
        assert!(parse_tokens(["-1"].into_iter()).is_err());
        assert!(parse_tokens(["4294967296"].into_iter()).is_err());
    }
}
