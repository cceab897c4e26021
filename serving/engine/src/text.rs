//! Text in and out of an engine: the tokenizer, the chat template, and incremental
//! detokenization with stop strings.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;

use super::EngineError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`, `developer`: passed to the template as is).
    pub role: String,
    /// The text.
    pub content: String,
}

/// Text to tokens and back, and the chat template.
#[derive(Debug, Clone)]
pub struct TextCodec {
    kind: CodecKind,
    template: String,
    bos: Option<String>,
    eos: Option<String>,
    /// Tokens that end a generation.
    stop_tokens: Vec<u32>,
}

#[derive(Debug, Clone)]
enum CodecKind {
    /// A Hugging Face tokenizer (from a GGUF's vocabulary or a tokenizer.json).
    Hf(Box<tokenizers::Tokenizer>),
    /// One token per byte (the mock engine): ids 0..=255 are bytes, then the specials.
    Bytes { specials: Vec<String> },
}

/// ChatML, the template of SmolLM2 and the fallback when a model carries none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl TextCodec {
    /// The codec a worker registered (reads a GGUF's metadata, not its weights).
    pub fn from_spec(spec: &kvfabric::contract::discovery::CodecSpec) -> Result<Self, EngineError> {
        use kvfabric::contract::discovery::CodecSpec;
        match spec {
            CodecSpec::Bytes => Ok(TextCodec::bytes()),
            CodecSpec::ModelDir { path } => TextCodec::from_model_dir(path),
            CodecSpec::Gguf { path, tokenizer } => {
                TextCodec::from_gguf_path(path, tokenizer.as_deref())
            }
        }
    }

    /// The tokenizer and chat template stored in a GGUF file's metadata (a `gpt2`-style BPE
    /// vocabulary), or from `tokenizer_json` when given.
    pub fn from_gguf(
        content: &gguf_file::Content,
        tokenizer_json: Option<&Path>,
    ) -> Result<Self, EngineError> {
        let meta_str = |k: &str| {
            content.metadata.get(k).and_then(|v| v.to_string().ok()).map(|s| s.to_string())
        };
        let meta_u32 = |k: &str| content.metadata.get(k).and_then(|v| v.to_u32().ok());
        let tok = match tokenizer_json {
            Some(p) => tokenizers::Tokenizer::from_file(p)
                .map_err(|e| EngineError::model(format!("tokenizer {}: {e}", p.display())))?,
            None => {
                let mut tok = tokenizers::Tokenizer::from_gguf(content)
                    .map_err(|e| EngineError::model(format!("GGUF tokenizer: {e}")))?;
                if meta_str("tokenizer.ggml.pre").as_deref() == Some("smollm") {
                    // SmolLM's tokenizer.json: digits one by one, then GPT-2 byte-level
                    // without a prefix space. candle's GGUF reader does not know this
                    // pre-tokenizer and would add a prefix space.
                    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
                    use tokenizers::pre_tokenizers::digits::Digits;
                    use tokenizers::pre_tokenizers::sequence::Sequence;
                    let pre: tokenizers::PreTokenizerWrapper = Sequence::new(vec![
                        Digits::new(true).into(),
                        ByteLevel::new(false, true, true).into(),
                    ])
                    .into();
                    tok.with_pre_tokenizer(Some(pre));
                    tok.with_decoder(Some(ByteLevel::new(false, true, true)));
                    tok.with_post_processor(Some(ByteLevel::new(false, true, true)));
                }
                tok
            }
        };
        let bos = meta_u32("tokenizer.ggml.bos_token_id");
        let eos = meta_u32("tokenizer.ggml.eos_token_id");
        let template =
            meta_str("tokenizer.chat_template").unwrap_or_else(|| CHATML_TEMPLATE.to_string());
        Self::hf(tok, template, bos, eos)
    }

    /// The codec of a Hugging Face model directory: `tokenizer.json`, and from
    /// `tokenizer_config.json` the chat template (or `chat_template.jinja`; ChatML when there
    /// is none) and the BOS and EOS tokens.
    pub fn from_model_dir(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer.json");
        let tok = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| EngineError::model(format!("tokenizer {}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| EngineError::model(format!("{}: {e}", cfg_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(EngineError::model(format!("{}: {e}", cfg_path.display()))),
        };
        // A special token is a string, or an object with its `content`.
        let special = |k: &str| {
            let v = &cfg[k];
            v.as_str().or_else(|| v["content"].as_str()).and_then(|t| tok.token_to_id(t))
        };
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let template = match cfg["chat_template"].as_str() {
            Some(t) => t.to_string(),
            None => std::fs::read_to_string(dir.join("chat_template.jinja"))
                .unwrap_or_else(|_| CHATML_TEMPLATE.to_string()),
        };
        Self::hf(tok, template, bos, eos)
    }

    fn hf(
        mut tok: tokenizers::Tokenizer,
        template: String,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
    ) -> Result<Self, EngineError> {
        tok.with_truncation(None).map_err(|e| EngineError::model(e.to_string()))?;
        tok.with_padding(None);
        let id_text = |id: Option<u32>| id.and_then(|id| tok.id_to_token(id));
        let bos = id_text(bos_id);
        let eos = id_text(eos_id);
        let mut stop_tokens: Vec<u32> = eos_id.into_iter().collect();
        // Chat models end a turn with their end-of-turn token, which may differ from EOS.
        for t in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(id) = tok.token_to_id(t) {
                if !stop_tokens.contains(&id) {
                    stop_tokens.push(id);
                }
            }
        }
        let codec =
            TextCodec { kind: CodecKind::Hf(Box::new(tok)), template, bos, eos, stop_tokens };
        // Fail at load, not at the first request, on a template minijinja cannot parse.
        codec.render_chat(&[ChatMessage { role: "user".into(), content: "hi".into() }])?;
        Ok(codec)
    }

    /// Writes this codec as a model directory's `tokenizer.json` and `tokenizer_config.json`
    /// (what [`TextCodec::from_model_dir`] reads).
    pub fn save_to_dir(&self, dir: &Path) -> Result<(), EngineError> {
        let CodecKind::Hf(tok) = &self.kind else {
            return Err(EngineError::invalid("the byte codec has no tokenizer.json"));
        };
        let io = |e: &dyn std::fmt::Display| EngineError::model(format!("{}: {e}", dir.display()));
        tok.save(dir.join("tokenizer.json"), false).map_err(|e| io(&e))?;
        let cfg = serde_json::json!({
            "chat_template": self.template,
            "bos_token": self.bos,
            "eos_token": self.eos,
        });
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).map_err(|e| io(&e))
    }

    /// [`TextCodec::from_gguf`] of a file: reads its metadata only, not its weights.
    pub fn from_gguf_path(path: &Path, tokenizer_json: Option<&Path>) -> Result<Self, EngineError> {
        let file = std::fs::File::open(path)
            .map_err(|e| EngineError::model(format!("opening {}: {e}", path.display())))?;
        let mut r = std::io::BufReader::new(file);
        let content = gguf_file::Content::read(&mut r)
            .map_err(|e| EngineError::model(format!("reading {}: {e}", path.display())))?;
        Self::from_gguf(&content, tokenizer_json)
    }

    /// The byte codec of the mock engine: ids 0..=255 are bytes; `<|im_start|>`,
    /// `<|im_end|>` and `<|endoftext|>` follow; ChatML template.
    pub fn bytes() -> Self {
        let specials: Vec<String> =
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().map(|s| s.to_string()).collect();
        TextCodec {
            kind: CodecKind::Bytes { specials },
            template: CHATML_TEMPLATE.to_string(),
            bos: None,
            eos: Some("<|endoftext|>".into()),
            stop_tokens: vec![256, 258],
        }
    }

    /// Tokens that end a generation (EOS and end-of-turn).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// Vocabulary size (with added tokens).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            CodecKind::Hf(t) => t.get_vocab_size(true),
            CodecKind::Bytes { specials } => 256 + specials.len(),
        }
    }

    /// Tokens of `text`; special-token text (`<|im_start|>`) becomes the special token.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        match &self.kind {
            CodecKind::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| EngineError::invalid(format!("tokenizing the prompt: {e}"))),
            CodecKind::Bytes { specials } => {
                let mut out = Vec::with_capacity(text.len());
                let mut rest = text;
                'outer: while !rest.is_empty() {
                    for (i, s) in specials.iter().enumerate() {
                        if let Some(r) = rest.strip_prefix(s.as_str()) {
                            out.push(256 + i as u32);
                            rest = r;
                            continue 'outer;
                        }
                    }
                    let c = rest.chars().next().unwrap_or(' ');
                    let mut buf = [0u8; 4];
                    out.extend(c.encode_utf8(&mut buf).bytes().map(u32::from));
                    rest = &rest[c.len_utf8()..];
                }
                Ok(out)
            }
        }
    }

    /// Text of `tokens`, special tokens skipped (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match &self.kind {
            CodecKind::Hf(t) => t.decode(tokens, true).unwrap_or_default(),
            CodecKind::Bytes { .. } => {
                let bytes: Vec<u8> =
                    tokens.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }

    /// The chat template applied to `messages`, with the assistant's turn opened.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.template)
            .map_err(|e| EngineError::model(format!("chat template: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| EngineError::model(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        })
        .map_err(|e| EngineError::invalid(format!("chat template: {e}")))
    }
}

/// Turns a growing token sequence into text deltas: holds back bytes that do not yet form
/// complete UTF-8 and text that may be the start of a stop string.
#[derive(Debug)]
pub struct TextStream {
    tokens: Vec<u32>,
    /// Text decoded so far (complete characters only).
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    stops: Vec<String>,
}

impl TextStream {
    /// A stream that ends at any of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        TextStream { tokens: Vec::new(), text: String::new(), sent: 0, stops }
    }

    /// Adds a token; returns the text that can be sent now, and whether a stop string was
    /// reached (the text then ends before it, and the stream is over).
    pub fn push(&mut self, codec: &TextCodec, token: u32) -> (String, bool) {
        self.tokens.push(token);
        let full = codec.decode(&self.tokens);
        // A trailing U+FFFD may be a character whose bytes have not all arrived.
        if full.ends_with('\u{FFFD}') {
            return (String::new(), false);
        }
        self.text = full;
        if let Some(at) = self.stop_at() {
            let out = self.text.get(self.sent..at).unwrap_or_default().to_string();
            // Nothing after the stop string is ever sent, not even by `flush`.
            self.text.truncate(at);
            self.sent = at;
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&n| s.is_char_boundary(n)).map(|n| &s[..n]))
            .filter(|p| self.text.ends_with(p))
            .map(|p| p.len())
            .max()
            .unwrap_or(0);
        let end = self.text.len() - hold;
        if end <= self.sent {
            return (String::new(), false);
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// What was held back, at the end of a generation that hit no stop string.
    pub fn flush(&mut self) -> String {
        let out = self.text.get(self.sent..).unwrap_or_default().to_string();
        self.sent = self.text.len();
        out
    }

    fn stop_at(&self) -> Option<usize> {
        // Only a match that ends in text not yet sent is new.
        self.stops
            .iter()
            .filter_map(|s| {
                let from = self.sent.saturating_sub(s.len() - 1);
                let from = (from..=self.sent).find(|&i| self.text.is_char_boundary(i))?;
                self.text[from..].find(s.as_str()).map(|i| from + i)
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_all(codec: &TextCodec, text: &str, stops: &[&str]) -> (String, bool) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for t in codec.encode(text).unwrap() {
            let (d, stop) = s.push(codec, t);
            out.push_str(&d);
            if stop {
                return (out, true);
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn byte_codec_round_trips_and_keeps_multibyte_characters_whole() {
        let c = TextCodec::bytes();
        let text = "héllo <|im_end|> 日本";
        let ids = c.encode(text).unwrap();
        assert!(ids.contains(&258));
        assert_eq!(c.decode(&ids), "héllo  日本");
        let mut s = TextStream::new(vec![]);
        let mut deltas = Vec::new();
        for t in c.encode("日本").unwrap() {
            deltas.push(s.push(&c, t).0);
        }
        // Three bytes per character: nothing until each one is complete.
        assert_eq!(deltas, ["", "", "日", "", "", "本"]);
    }

    #[test]
    fn stop_strings_end_the_stream_before_them_and_partial_matches_are_held() {
        let c = TextCodec::bytes();
        assert_eq!(stream_all(&c, "abc STOP def", &["STOP"]), ("abc ".into(), true));
        assert_eq!(stream_all(&c, "abc STO", &["STOP"]), ("abc STO".into(), false));
        assert_eq!(stream_all(&c, "a\n\nb", &["\n\n", "b"]), ("a".into(), true));
        assert_eq!(stream_all(&c, "no stop here", &[]), ("no stop here".into(), false));
        let mut s = TextStream::new(vec!["ww".into()]);
        let got: String =
            c.encode("abwwcd").unwrap().into_iter().map(|t| s.push(&c, t).0).collect();
        assert_eq!(
            (got.as_str(), s.flush().as_str()),
            ("ab", ""),
            "flush after a stop sends nothing"
        );
    }

    #[test]
    fn chatml_template_renders_a_conversation() {
        let c = TextCodec::bytes();
        let s = c
            .render_chat(&[
                ChatMessage { role: "system".into(), content: "Be brief.".into() },
                ChatMessage { role: "user".into(), content: "Hi".into() },
            ])
            .unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
