//! The optional shared secret between the filter and the sidecar: a gRPC
//! interceptor and an admin-page check, comparing in constant time.

use tonic::{Request, Status};

/// `Bearer <token>` in constant time (no early exit on the first mismatch).
pub(crate) fn matches(header: Option<&str>, token: &str) -> bool {
    let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
        return false;
    };
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses gRPC calls without the token, when one is configured.
#[derive(Debug, Clone)]
pub(crate) struct GrpcToken(Option<std::sync::Arc<str>>);

impl GrpcToken {
    pub(crate) fn new(token: Option<String>) -> Self {
        Self(token.map(Into::into))
    }
}

impl tonic::service::Interceptor for GrpcToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.0 else {
            return Ok(request);
        };
        let header = request.metadata().get("authorization").and_then(|v| v.to_str().ok());
        if matches(header, token) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or wrong kvmesh token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_matches() {
        assert!(matches(Some("Bearer s3cret"), "s3cret"));
        assert!(!matches(Some("Bearer s3cre"), "s3cret"));
        assert!(!matches(Some("s3cret"), "s3cret"));
        assert!(!matches(None, "s3cret"));
    }
}
